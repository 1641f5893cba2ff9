"""Interoperability: convert checkpoints between deltackpt and other formats.

:func:`convert` reads a ``torch.save`` file, a DCP directory, safetensors
files or a DeepSpeed universal checkpoint and writes it as a deltackpt
directory, safetensors, DCP or ``torch.save``. The pieces are public too:
:func:`read_checkpoint` (:mod:`~deltackpt.interop.sources`) gives any
source as a :class:`~deltackpt.state.CapturedState`, and :func:`export`
(:mod:`~deltackpt.interop.exporters`) writes one, as ``deltackpt restore
--format`` does for a restored step.
"""

from deltackpt.interop.convert import ConvertReport, convert
from deltackpt.interop.exporters import OUT_FORMATS, Export, export
from deltackpt.interop.sources import SOURCE_FORMATS, Source, detect_format, read_checkpoint

__all__ = ["OUT_FORMATS", "SOURCE_FORMATS", "ConvertReport", "Export", "Source", "convert",
           "detect_format", "export", "read_checkpoint"]
