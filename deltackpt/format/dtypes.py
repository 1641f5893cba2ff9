"""The dtypes the format can store, by their on-disk names (docs/FORMAT.md 2.4)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from deltackpt.errors import FormatError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DTypeSpec:
    """How one dtype is stored.

    ``word`` is the element width the byte-plane codec splits on (1: no
    split) and ``rotate`` whether elements are IEEE floats whose sign bit is
    rotated out of the exponent byte. The table needs no torch, so reading
    metadata (``deltackpt ls``, ``info``, ``verify``) does not import it.
    """

    name: str
    itemsize: int
    word: int
    rotate: bool

    @property
    def integer(self) -> bool:
        """Whether elements are integers (signed or not)."""
        return self.name.startswith(("int", "uint"))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this name."""
        try:
            return _torch_dtypes()[self.name]
        except KeyError:
            import torch

            raise FormatError(f"dtype {self.name} needs a newer torch than {torch.__version__}") from None


BY_NAME: dict[str, DTypeSpec] = {s.name: s for s in [
    DTypeSpec("float64", 8, 8, True),
    DTypeSpec("float32", 4, 4, True),
    DTypeSpec("float16", 2, 2, True),
    DTypeSpec("bfloat16", 2, 2, True),
    DTypeSpec("complex64", 8, 4, True),
    DTypeSpec("complex128", 16, 8, True),
    DTypeSpec("int64", 8, 8, False),
    DTypeSpec("int32", 4, 4, False),
    DTypeSpec("int16", 2, 2, False),
    DTypeSpec("int8", 1, 1, False),
    DTypeSpec("uint8", 1, 1, False),
    DTypeSpec("bool", 1, 1, False),
    *(DTypeSpec(name, 1, 1, False) for name in (
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")),
    DTypeSpec("uint16", 2, 2, False),
    DTypeSpec("uint32", 4, 4, False),
    DTypeSpec("uint64", 8, 8, False),
]}
"""Every dtype of docs/FORMAT.md 2.4, by its on-disk name."""


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """The torch dtype of every name in :data:`BY_NAME` that this torch has."""
    import torch

    return {name: getattr(torch, name) for name in BY_NAME if hasattr(torch, name)}


@functools.cache
def _by_torch() -> dict[torch.dtype, DTypeSpec]:
    return {dtype: BY_NAME[name] for name, dtype in _torch_dtypes().items()}


def spec_for(dtype: torch.dtype, what: str = "tensor") -> DTypeSpec:
    """The storage spec of ``dtype``; ``what`` names the tensor in the error."""
    try:
        return _by_torch()[dtype]
    except KeyError:
        raise TypeError(f"{what}: dtype {dtype} cannot be stored by deltackpt "
                        f"(supported: {', '.join(BY_NAME)})") from None


def spec_named(name: str, what: str = "tensor") -> DTypeSpec:
    """The storage spec of the on-disk dtype ``name``."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise FormatError(f"{what}: unknown dtype {name!r} in metadata") from None


def float32_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw bytes of a ``float32``/``bfloat16``/``float16`` array as float32 values (exact;
    a view for float32)."""
    if dtype == "float32":
        return raw.view(np.float32)
    import torch

    return torch.from_numpy(raw).view(spec_named(dtype).torch_dtype).float().numpy()


def dtype_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to the nearest value of ``dtype``, as raw bytes (a view for
    float32)."""
    if dtype == "float32":
        return values.view(np.uint8)
    import torch

    return torch.from_numpy(values).to(spec_named(dtype).torch_dtype).view(torch.uint8).numpy()


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements in row-major order as a 1-d uint8 array (a view when possible)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()
