"""The dtypes the format can store, by their on-disk names (docs/FORMAT.md 2.4)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltackpt.errors import FormatError


@dataclass(frozen=True)
class DTypeSpec:
    """How one dtype is stored.

    ``word`` is the element width the byte-plane codec splits on (1: no
    split) and ``rotate`` whether elements are IEEE floats whose sign bit is
    rotated out of the exponent byte.
    """

    name: str
    torch_dtype: torch.dtype
    itemsize: int
    word: int
    rotate: bool

    @property
    def word_numpy(self) -> np.dtype:
        """Unsigned integer dtype of one ``word``."""
        return np.dtype(f"<u{self.word}")


def _spec(dtype: torch.dtype, word: int, rotate: bool) -> DTypeSpec:
    name = str(dtype).removeprefix("torch.")
    return DTypeSpec(name, dtype, dtype.itemsize, word, rotate)


_SPECS = [
    _spec(torch.float64, 8, True),
    _spec(torch.float32, 4, True),
    _spec(torch.float16, 2, True),
    _spec(torch.bfloat16, 2, True),
    _spec(torch.complex64, 4, True),
    _spec(torch.complex128, 8, True),
    _spec(torch.int64, 8, False),
    _spec(torch.int32, 4, False),
    _spec(torch.int16, 2, False),
    _spec(torch.int8, 1, False),
    _spec(torch.uint8, 1, False),
    _spec(torch.bool, 1, False),
]
_SPECS += [
    _spec(getattr(torch, name), 1, False)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                 "float8_e8m0fnu")
    if hasattr(torch, name)
]
_SPECS += [
    _spec(getattr(torch, name), width, False)
    for name, width in (("uint16", 2), ("uint32", 4), ("uint64", 8))
    if hasattr(torch, name)
]

BY_NAME: dict[str, DTypeSpec] = {s.name: s for s in _SPECS}
BY_TORCH: dict[torch.dtype, DTypeSpec] = {s.torch_dtype: s for s in _SPECS}


def spec_for(dtype: torch.dtype, what: str = "tensor") -> DTypeSpec:
    """The storage spec of ``dtype``; ``what`` names the tensor in the error."""
    try:
        return BY_TORCH[dtype]
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
    return torch.from_numpy(raw).view(spec_named(dtype).torch_dtype).float().numpy()


def dtype_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to the nearest value of ``dtype``, as raw bytes (a view for
    float32)."""
    if dtype == "float32":
        return values.view(np.uint8)
    return torch.from_numpy(values).to(spec_named(dtype).torch_dtype).view(torch.uint8).numpy()


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements in row-major order as a 1-d uint8 array (a view when possible)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()
