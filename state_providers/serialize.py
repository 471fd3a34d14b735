"""Python objects to JSON and back, through an explicit allow-list: loading runs no code.

Checkpoint dictionaries mix tensors with plain data (counters, hyper-parameters, scheduler and
RNG state) and a few library types (``torch.Size``, ``torch.dtype``, DeepSpeed's loss scaler).
``pickle`` would represent all of it and would also run whatever a file tells it to; this module
represents exactly the types below and refuses anything else *at save time*, naming the key, so
an unrepresentable object is found when the snapshot is taken, not when it is needed.

Encoding (a JSON tree; tagged objects are single-key dicts whose key starts with ``__``):

=====================================  ===============================================
Python                                 JSON
=====================================  ===============================================
None, bool, int, float (nan, inf ok)   native
str                                    native
list                                   list
dict with str keys (none starting       object
``__``)
other dict, OrderedDict                ``{"__dict__": [[key, value], ...]}`` (order kept)
tuple                                  ``{"__tuple__": [...]}``
set, frozenset                         ``{"__set__": [...]}``, ``{"__frozenset__": [...]}`` (elements
                                       in the order of their JSON text: the same set, the same bytes)
bytes                                  ``{"__bytes__": base64}``
torch.Size / dtype / device            ``{"__size__": [...]}``, ``{"__dtype__": "float32"}``, ``{"__device__": "cpu"}``
numpy array / numpy scalar             ``{"__ndarray__": {dtype, shape, data: base64}}``, ``{"__npscalar__": ...}``
an allow-listed enum member            ``{"__enum__": ["module:Class", value]}``
an allow-listed plain class            ``{"__object__": ["module:Class", {attribute: value}]}``
a tensor                               ``{"__tensor__": [index, dtype, shape]}`` (the caller stores
                                       the tensor; its dtype and shape are checked when it is
                                       read back; a bare ``index``, as older files hold, is read too)
=====================================  ===============================================
"""

from __future__ import annotations

import base64
import enum
import importlib
import json
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch


class UnrepresentableError(TypeError):
    """An object in the state cannot be represented without pickle; the message names its key."""


class DecodeError(ValueError):
    """A serialized tree holds a tag or a class outside the allow-list (a corrupt or foreign file)."""


def _default_allowed() -> Dict[str, type]:
    names = [
        "deepspeed.runtime.fp16.loss_scaler:LossScaler",
        "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
        "deepspeed.utils.tensor_fragment:fragment_address",
        "deepspeed.runtime.zero.config:ZeroStageEnum",
    ]
    out = {}
    for n in names:
        mod, _, cls = n.partition(":")
        try:
            out[n] = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):  # pragma: no cover - depends on the DeepSpeed version
            continue
    return out


_ALLOWED: Dict[str, type] = {}


def allowed_classes() -> Dict[str, type]:
    """``"module:Class" -> class`` of the classes that may be represented (and rebuilt)."""
    if not _ALLOWED:
        _ALLOWED.update(_default_allowed())
    return _ALLOWED


def allow_class(cls: type) -> None:
    """Add a plain class (state in ``__dict__``) or an enum to the allow-list."""
    allowed_classes()[f"{cls.__module__}:{cls.__qualname__}"] = cls


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class TensorSink(list):
    """The tensors met by :func:`encode`, in order, with the key path of each (``paths``)."""

    def __init__(self):
        super().__init__()
        self.paths: List[str] = []


def encode(obj: Any, tensors: List[torch.Tensor], key: str = "") -> Any:
    """Encode ``obj`` into a JSON-able tree; tensors are appended to ``tensors`` and replaced by
    their index (a :class:`TensorSink` also records each tensor's key path).

    Raises:
        UnrepresentableError: an object outside the allow-list (names its key path).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int) and not isinstance(obj, enum.Enum):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        if isinstance(tensors, TensorSink):
            tensors.paths.append(key.lstrip("/"))
        return {"__tensor__": [len(tensors) - 1, str(obj.dtype).removeprefix("torch."), list(obj.shape)]}
    if isinstance(obj, torch.Size):
        return {"__size__": list(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).replace("torch.", "")}
    if isinstance(obj, torch.device):
        return {"__device__": str(obj)}
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise UnrepresentableError(
                f"{key.lstrip('/') or '<root>'}: numpy array of Python objects cannot be represented"
            )
        return {
            "__ndarray__": {
                "dtype": obj.dtype.str,
                "shape": list(obj.shape),
                "data": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode(),
            }
        }
    if isinstance(obj, np.generic):
        return {"__npscalar__": [obj.dtype.str, base64.b64encode(obj.tobytes()).decode()]}
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {"__tuple__": [encode(v, tensors, f"{key}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{key}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):  # DeepSpeed 0.19.7 saves sparse_tensor_module_names, a set
        elements = sorted((encode(v, tensors, f"{key}/<element>") for v in obj), key=json.dumps)
        return {"__frozenset__" if isinstance(obj, frozenset) else "__set__": elements}
    if isinstance(obj, dict):
        plain = type(obj) is dict and all(isinstance(k, str) and not k.startswith("__") for k in obj)
        if plain:
            return {k: encode(v, tensors, f"{key}/{k}") for k, v in obj.items()}
        return {
            "__dict__": [[encode(k, tensors, f"{key}/<key>"), encode(v, tensors, f"{key}/{k}")] for k, v in obj.items()]
        }
    allowed = allowed_classes()
    name = _name(type(obj))
    if name in allowed:
        if isinstance(obj, enum.Enum):
            return {"__enum__": [name, encode(obj.value, tensors, key)]}
        return {"__object__": [name, {k: encode(v, tensors, f"{key}/{k}") for k, v in vars(obj).items()}]}
    raise UnrepresentableError(
        f"{key.lstrip('/') or '<root>'}: object of type {type(obj).__module__}.{type(obj).__qualname__} "
        "cannot be represented in a snapshot without pickle; add it with "
        "state_providers.serialize.allow_class if it is plain data"
    )


def decode(tree: Any, tensor_of: Callable[[int], torch.Tensor], key: str = "") -> Any:
    """Rebuild what :func:`encode` produced; ``tensor_of(i)`` returns the i-th tensor.

    Raises:
        DecodeError: an unknown tag or a class outside the allow-list.
    """
    if isinstance(tree, list):
        return [decode(v, tensor_of, f"{key}/{i}") for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, val),) = tree.items()
        if tag.startswith("__"):
            return _decode_tag(tag, val, tensor_of, key)
    return {k: decode(v, tensor_of, f"{key}/{k}") for k, v in tree.items()}


def _decode_tag(tag: str, val: Any, tensor_of, key: str) -> Any:
    if tag == "__tensor__":
        if not isinstance(val, list):
            return tensor_of(int(val))
        index, dtype, shape = val
        t = tensor_of(int(index))
        got = (str(t.dtype).removeprefix("torch."), [int(d) for d in t.shape])
        if got != (dtype, shape):
            raise DecodeError(
                f"{key}: tensor {index} is {got[0]} {got[1]} in the file, {dtype} {shape} in its skeleton"
            )
        return t
    if tag == "__tuple__":
        return tuple(decode(v, tensor_of, f"{key}/{i}") for i, v in enumerate(val))
    if tag in ("__set__", "__frozenset__"):
        elements = (_hashable(decode(v, tensor_of, f"{key}/<element>")) for v in val)
        return set(elements) if tag == "__set__" else frozenset(elements)
    if tag == "__dict__":
        return {_hashable(decode(k, tensor_of, key)): decode(v, tensor_of, f"{key}/{k}") for k, v in val}
    if tag == "__size__":
        return torch.Size(val)
    if tag == "__dtype__":
        dt = getattr(torch, str(val), None)
        if not isinstance(dt, torch.dtype):
            raise DecodeError(f"{key}: unknown dtype {val!r}")
        return dt
    if tag == "__device__":
        return torch.device(val)
    if tag == "__bytes__":
        return base64.b64decode(val)
    if tag == "__ndarray__":
        arr = np.frombuffer(base64.b64decode(val["data"]), dtype=np.dtype(val["dtype"]))
        return arr.reshape(val["shape"]).copy()
    if tag == "__npscalar__":
        return np.frombuffer(base64.b64decode(val[1]), dtype=np.dtype(val[0]))[0]
    if tag in ("__enum__", "__object__"):
        name, state = val
        cls = allowed_classes().get(name)
        if cls is None:
            raise DecodeError(f"{key}: class {name} is not on the allow-list; refusing to rebuild it")
        if tag == "__enum__":
            return cls(decode(state, tensor_of, key))
        obj = cls.__new__(cls)
        obj.__dict__.update({k: decode(v, tensor_of, f"{key}/{k}") for k, v in state.items()})
        return obj
    raise DecodeError(f"{key}: unknown tag {tag!r}")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def dumps(obj: Any, key: str = "") -> Tuple[bytes, "TensorSink"]:
    """``(JSON bytes, tensors)`` for ``obj``; ``tensors.paths`` holds each tensor's key path."""
    tensors = TensorSink()
    tree = encode(obj, tensors, key)
    return json.dumps(tree, allow_nan=True, separators=(",", ":")).encode(), tensors


def loads(data: bytes, tensor_of: Callable[[int], torch.Tensor], key: str = "") -> Any:
    """Inverse of :func:`dumps`.

    Raises:
        DecodeError: not JSON, or a tag/class outside the allow-list.
    """
    try:
        tree = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DecodeError(f"{key}: serialized object is not valid JSON: {err}") from None
    return decode(tree, tensor_of, key)


def equal(a: Any, b: Any) -> bool:
    """Structural equality that treats NaN as equal to NaN and compares tensors/arrays by value."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(equal(a[k], b[k]) for k in a)
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return equal(vars(a), vars(b))
    return a == b


__all__ = [
    "UnrepresentableError",
    "DecodeError",
    "TensorSink",
    "encode",
    "decode",
    "dumps",
    "loads",
    "allow_class",
    "allowed_classes",
    "equal",
    "OrderedDict",
]
