"""Tagged JSON for non-tensor state (docs/FORMAT.md 2.5).

Optimizer hyperparameters, scheduler state, RNG states and the user's
``extra`` are trees of Python values. They are written as JSON that
round-trips exactly (tuples stay tuples, NaN stays NaN, int keys stay int)
and never through pickle. Tensors inside a tree are handed to a callback,
stored like every other tensor, and referenced by name.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deltackpt.errors import FormatError

TensorSink = Callable[[tuple[str, ...], torch.Tensor], str]
TensorSource = Callable[[str], torch.Tensor]

_FLOAT_TAGS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _path_text(path: tuple[str, ...]) -> str:
    return path[0] + "".join(f"[{p!r}]" for p in path[1:])


def encode_tree(value: Any, path: tuple[str, ...], on_tensor: TensorSink) -> Any:
    """JSON-able form of ``value``; tensors go to ``on_tensor(path, tensor)`` which names them.

    Raises ``TypeError`` naming the path of the first value that cannot be stored.
    """
    if isinstance(value, np.generic):  # before float/str: np.float64 and np.str_ subclass them
        return {"$npscalar": [value.dtype.str, encode_tree(value.item(), path, on_tensor)]}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        return {"$tensor": on_tensor(path, value)}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{_path_text(path)}: numpy object arrays cannot be stored")
        contiguous = np.ascontiguousarray(value).reshape(value.shape)  # keeps 0-d arrays 0-d
        return {"$ndarray": on_tensor(path, torch.from_numpy(contiguous))}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [encode_tree(v, (*path, str(i)), on_tensor) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode_tree(v, (*path, str(i)), on_tensor) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_tree(v, (*path, k), on_tensor) for k, v in value.items()}
        # Entry i's key and value sit under "$k<i>" and "$v<i>": plain keys never start with "$".
        return {"$dict": [[encode_tree(k, (*path, f"$k{i}"), on_tensor),
                           encode_tree(v, (*path, f"$v{i}"), on_tensor)]
                          for i, (k, v) in enumerate(value.items())]}
    raise TypeError(f"{_path_text(path)}: cannot store a {type(value).__qualname__}; "
                    "use JSON-able values (None, bool, int, float, str, list, tuple, dict), "
                    "bytes, numpy arrays or tensors")


def decode_tree(obj: Any, get_tensor: TensorSource) -> Any:
    """Inverse of :func:`encode_tree`; ``get_tensor(name)`` supplies referenced tensors."""
    if isinstance(obj, list):
        return [decode_tree(v, get_tensor) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        tag, body = next(iter(obj.items()))
        if tag.startswith("$"):
            return _decode_tagged(tag, body, get_tensor)
    return {k: decode_tree(v, get_tensor) for k, v in obj.items()}


def _decode_tagged(tag: str, body: Any, get_tensor: TensorSource) -> Any:
    if tag == "$float" and body in _FLOAT_TAGS:
        return _FLOAT_TAGS[body]
    if tag == "$tuple" and isinstance(body, list):
        return tuple(decode_tree(v, get_tensor) for v in body)
    if tag == "$dict" and isinstance(body, list) and all(
            isinstance(kv, list) and len(kv) == 2 for kv in body):
        return {_hashable(decode_tree(k, get_tensor)): decode_tree(v, get_tensor) for k, v in body}
    if tag == "$bytes" and isinstance(body, str):
        return base64.b64decode(body)
    if tag == "$tensor" and isinstance(body, str):
        return get_tensor(body)
    if tag == "$ndarray" and isinstance(body, str):
        return get_tensor(body).numpy()
    if tag == "$npscalar" and isinstance(body, list) and len(body) == 2:
        return np.dtype(body[0]).type(decode_tree(body[1], get_tensor))
    raise FormatError(f"invalid tagged value {{{tag!r}: {body!r}}} in state")


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise FormatError(f"invalid dict key {key!r} in state")
    return key
