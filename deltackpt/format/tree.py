"""Tagged JSON for non-tensor state (docs/FORMAT.md 2.5).

Optimizer hyperparameters, scheduler state, RNG states and the user's
``extra`` are trees of Python values. They are written as JSON that
round-trips exactly (tuples stay tuples, NaN stays NaN, int keys stay int)
and never through pickle. Tensors inside a tree are handed to a callback,
stored like every other tensor, and referenced by name.

A tree read from disk is untrusted: :func:`check_tree` checks that
:func:`decode_tree` decodes it (tags, references, nesting) before anything
reads it.
"""

from __future__ import annotations

import base64
import math
import re
import reprlib
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from deltackpt.errors import FormatError

if TYPE_CHECKING:  # checking a tree read from disk needs no torch (deltackpt ls, info, verify)
    import torch

TensorSink = Callable[[tuple[str, ...], "torch.Tensor"], str]
TensorSource = Callable[[str], "torch.Tensor"]

_FLOAT_TAGS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MAX_DEPTH = 64  # levels of arrays and objects one encoded value may nest (FORMAT.md 2.5)
# Stored dtypes numpy has (``$ndarray``): all of FORMAT.md 2.4 but bfloat16 and the float8s.
NDARRAY_DTYPES = frozenset({"float64", "float32", "float16", "complex64", "complex128", "int64",
                            "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"})
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def _path_text(path: tuple[str, ...]) -> str:
    return path[0] + "".join(f"[{p!r}]" for p in path[1:])


def encode_tree(value: Any, path: tuple[str, ...], on_tensor: TensorSink) -> Any:
    """JSON-able form of ``value``; tensors go to ``on_tensor(path, tensor)`` which names them.

    Raises ``TypeError`` naming the path of the first value that cannot be stored, or that
    nests deeper than ``MAX_DEPTH`` levels once encoded.
    """
    return _encode(value, path, on_tensor, MAX_DEPTH)


def _encode(value: Any, path: tuple[str, ...], on_tensor: TensorSink, room: int) -> Any:
    """:func:`encode_tree` of a value that may nest ``room`` more levels."""
    if isinstance(value, np.generic):  # before float/str: np.float64 and np.str_ subclass them
        _fits(path, room, 2)
        return {"$npscalar": [value.dtype.str, _encode(value.item(), path, on_tensor, room - 2)]}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        _fits(path, room, 1)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    torch = sys.modules.get("torch")  # a value can be a tensor only once torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        _fits(path, room, 1)
        return {"$tensor": on_tensor(path, value)}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{_path_text(path)}: numpy object arrays cannot be stored")
        _fits(path, room, 1)
        import torch

        contiguous = np.ascontiguousarray(value).reshape(value.shape)  # keeps 0-d arrays 0-d
        return {"$ndarray": on_tensor(path, torch.from_numpy(contiguous))}
    if isinstance(value, bytes):
        _fits(path, room, 1)
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        _fits(path, room, 1)
        return [_encode(v, (*path, str(i)), on_tensor, room - 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        _fits(path, room, 2)
        return {"$tuple": [_encode(v, (*path, str(i)), on_tensor, room - 2)
                           for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            _fits(path, room, 1)
            return {k: _encode(v, (*path, k), on_tensor, room - 1) for k, v in value.items()}
        # Entry i's key and value sit under "$k<i>" and "$v<i>": plain keys never start with "$".
        _fits(path, room, 3)
        return {"$dict": [[_encode(k, (*path, f"$k{i}"), on_tensor, room - 3),
                           _encode(v, (*path, f"$v{i}"), on_tensor, room - 3)]
                          for i, (k, v) in enumerate(value.items())]}
    raise TypeError(f"{_path_text(path)}: cannot store a {type(value).__qualname__}; "
                    "use JSON-able values (None, bool, int, float, str, list, tuple, dict), "
                    "bytes, numpy arrays or tensors")


def _fits(path: tuple[str, ...], room: int, levels: int) -> None:
    """Raise ``TypeError`` unless ``levels`` more levels of nesting fit in ``room``."""
    if room < levels:
        raise TypeError(f"{_path_text(path)}: nested deeper than {MAX_DEPTH} levels once encoded "
                        "(FORMAT.md 2.5)")


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
    raise FormatError(f"invalid tagged value {{{tag!r}: {reprlib.repr(body)}}} in state")


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise FormatError(f"invalid dict key {key!r} in state")
    return key


class _TreeError(FormatError):
    """A problem at ``path`` (keys and indices, innermost first) of a tree being checked."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message, self.path = message, []


def check_tree(obj: Any, dtypes: Mapping[str, str], where: str, depth: int = MAX_DEPTH) -> None:
    """Raise :class:`FormatError` naming ``where`` and the path unless :func:`decode_tree`
    decodes ``obj``: well-formed tags, ``$tensor``/``$ndarray`` names of tensors of the step
    (``dtypes``: their dtype names; an ``$ndarray`` one numpy has), ``$dict`` keys that decode
    to hashable values, ``$npscalar`` values their dtype holds, and at most ``depth`` levels of
    arrays and objects."""
    try:
        _check(obj, dtypes, depth)
    except _TreeError as exc:
        at = "".join(f"[{reprlib.repr(p)}]" for p in reversed(exc.path))
        at = at if len(at) <= 80 else f"{at[:60]}...{at[-17:]}"
        raise FormatError(f"{where}{at}: {exc.message}") from None


def _check(obj: Any, dtypes: Mapping[str, str], room: int) -> None:
    cls = obj.__class__
    if cls is not list and cls is not dict:
        return
    if room == 0:
        raise _TreeError("nested too deep")
    if cls is list:
        items: Any = enumerate(obj)
    elif len(obj) == 1 and next(iter(obj)).startswith("$"):
        _check_tagged(*next(iter(obj.items())), dtypes, room - 1)
        return
    else:
        items = obj.items()
    for key, value in items:
        if value.__class__ is not list and value.__class__ is not dict:
            continue  # a scalar: nothing to check (RNG states hold hundreds of them)
        try:
            _check(value, dtypes, room - 1)
        except _TreeError as exc:
            exc.path.append(key)
            raise


def _check_tagged(tag: str, body: Any, dtypes: Mapping[str, str], room: int) -> None:
    """Check the body of a tagged value; ``room``: the levels left below the tag's object."""
    if tag == "$float":
        ok = body.__class__ is str and body in _FLOAT_TAGS
    elif tag == "$tuple":
        ok = body.__class__ is list
    elif tag == "$dict":
        ok = body.__class__ is list and all(kv.__class__ is list and len(kv) == 2 for kv in body)
    elif tag == "$bytes":
        ok = body.__class__ is str and _BASE64.fullmatch(body) is not None
    elif tag in ("$tensor", "$ndarray"):
        ok = body.__class__ is str and body in dtypes and (
            tag == "$tensor" or dtypes[body] in NDARRAY_DTYPES)
    elif tag == "$npscalar":
        ok = body.__class__ is list and len(body) == 2 and _scalar_fits(*body)
    else:
        ok = False
    if not ok:
        raise _TreeError(f"invalid tagged value {{{tag!r}: {reprlib.repr(body)}}}")
    if tag in ("$tuple", "$dict", "$npscalar"):
        try:
            _check(body, dtypes, room)
        except _TreeError as exc:
            exc.path.append(tag)
            raise
    if tag == "$dict" and not all(_key_decodes(k) for k, _ in body):  # keys' nesting is checked
        raise _TreeError(f"a $dict key does not decode to a hashable value: {reprlib.repr(body)}")


def _key_decodes(key: Any) -> bool:
    """Whether a checked tree decodes to a value that can be a dict key."""
    if key.__class__ is list:
        return False
    if key.__class__ is not dict:
        return True
    if len(key) != 1:
        return False
    tag, body = next(iter(key.items()))
    if tag == "$tuple":
        return body.__class__ is list and all(_key_decodes(v) for v in body)
    return tag in ("$float", "$bytes", "$npscalar", "$tensor")


def _scalar_fits(dtype: Any, value: Any) -> bool:
    """Whether ``np.dtype(dtype).type(value)`` makes a numpy scalar (``$npscalar``) of a kind
    :func:`encode_tree` writes, holding ``value`` exactly."""
    if dtype.__class__ is not str or len(dtype) > 16:
        return False
    try:
        kind = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):
        return False
    if kind.kind in "iu":
        info = np.iinfo(kind)
        return value.__class__ is int and info.min <= value <= info.max
    tags = value.keys() if value.__class__ is dict else ()
    return {"b": value.__class__ is bool, "f": value.__class__ is float or tags == {"$float"},
            "U": value.__class__ is str, "S": tags == {"$bytes"}}.get(kind.kind, False)
