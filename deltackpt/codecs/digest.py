"""The xxh3-64 digest of a tensor's bytes, the checksum a chunk's raw bytes carry
(``raw_xxh3``, docs/FORMAT.md 3), computed where the quant codec's kernels code the tensor."""

from __future__ import annotations

import torch
import xxhash

from deltackpt.codecs.quant import on_device
from deltackpt.format.dtypes import raw_bytes


def tensor_digest(tensor: torch.Tensor) -> str:
    """The xxh3-64 hex digest of ``tensor``'s bytes: on its device where the Triton kernels code
    it (:func:`~deltackpt.codecs.quant.on_device`: a CUDA tensor is not copied to the host for
    it), else on the host."""
    if not on_device(tensor):
        return xxhash.xxh3_64_hexdigest(raw_bytes(tensor))
    from deltackpt.kernels.gpu_xxh3 import xxh3_64_on_device  # imports triton: only here

    values = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return xxh3_64_on_device(values.view(torch.uint8)).hexdigest()
