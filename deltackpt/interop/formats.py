"""The formats conversions read and write, by the names the command line and the API take."""

OUT_FORMATS = ("deltackpt", "safetensors", "dcp", "torch")
"""What :func:`~deltackpt.interop.convert` and :func:`~deltackpt.interop.export` write."""
SOURCE_FORMATS = ("torch", "dcp", "safetensors", "deepspeed")
"""What :func:`~deltackpt.interop.convert` and :func:`~deltackpt.interop.read_checkpoint` read."""
