"""Interoperability: convert checkpoints between deltackpt and other formats.

:func:`convert` reads a ``torch.save`` file, a DCP directory, safetensors
files or a DeepSpeed universal checkpoint and writes it as a deltackpt
directory, safetensors, DCP or ``torch.save``. The pieces are public too:
:func:`read_checkpoint` (:mod:`~deltackpt.interop.sources`) gives any
source as a :class:`~deltackpt.format.state.CapturedState`, and :func:`export`
(:mod:`~deltackpt.interop.exporters`) writes one, as ``deltackpt restore
--format`` does for a restored step. :class:`ShardingSpec`,
:func:`merge_states` and :func:`split_checkpoint` (:mod:`~deltackpt.interop.patterns`)
merge the ranks of a hand-sharded run into whole tensors and cut them again.
"""

from typing import TYPE_CHECKING

from deltackpt._lazy import lazy_attributes
from deltackpt.interop.formats import OUT_FORMATS, SOURCE_FORMATS

# Imported when first used (they import torch): the command line builds its options from the
# format names without them.
__getattr__, __dir__ = lazy_attributes(__name__, {
    "ConvertReport": "deltackpt.interop.convert",
    "convert": "deltackpt.interop.convert",
    "Export": "deltackpt.interop.exporters",
    "export": "deltackpt.interop.exporters",
    "Source": "deltackpt.interop.sources",
    "detect_format": "deltackpt.interop.sources",
    "read_checkpoint": "deltackpt.interop.sources",
    "ShardingSpec": "deltackpt.interop.patterns",
    "merge_states": "deltackpt.interop.patterns",
    "split_checkpoint": "deltackpt.interop.patterns",
})

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from deltackpt.interop.convert import ConvertReport, convert
    from deltackpt.interop.exporters import Export, export
    from deltackpt.interop.patterns import ShardingSpec, merge_states, split_checkpoint
    from deltackpt.interop.sources import Source, detect_format, read_checkpoint

__all__ = ["OUT_FORMATS", "SOURCE_FORMATS", "ConvertReport", "Export", "ShardingSpec", "Source",
           "convert", "detect_format", "export", "merge_states", "read_checkpoint",
           "split_checkpoint"]
