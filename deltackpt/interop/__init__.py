"""Interoperability: convert checkpoints between deltackpt and other formats.

:func:`convert` reads a ``torch.save`` file, a DCP directory, safetensors
files or a DeepSpeed universal checkpoint and writes it as a deltackpt
directory, safetensors, DCP or ``torch.save``. The pieces are public too:
:func:`read_checkpoint` (:mod:`~deltackpt.interop.sources`) gives any
source as a :class:`~deltackpt.format.state.CapturedState`, and :func:`export`
(:mod:`~deltackpt.interop.exporters`) writes one, as ``deltackpt restore
--format`` does for a restored step.
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
})

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from deltackpt.interop.convert import ConvertReport, convert
    from deltackpt.interop.exporters import Export, export
    from deltackpt.interop.sources import Source, detect_format, read_checkpoint

__all__ = ["OUT_FORMATS", "SOURCE_FORMATS", "ConvertReport", "Export", "Source", "convert",
           "detect_format", "export", "read_checkpoint"]
