"""State providers: live training state as an ordered stream of items, and back.

An *item* is either a tensor (a zero-copy view of live memory, with dtype, shape and attributes
such as its VPS key and region) or an object (bytes of the allow-listed JSON of
:mod:`state_providers.serialize`). Providers compose: a :class:`CompositeProvider` prefixes the
keys of its children, so an engine provider can hold an optimizer provider that holds partition
providers. The order of items is deterministic (children in order, tensors in the order they
appear), which is what lets a writer precompute file offsets.

Protocol (call order): ``items()`` any number of times while the state is unchanged;
``restore(items_by_key)`` with the items read back (tensors as CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from .serialize import dumps, loads

SKELETON = "__skeleton__"


@dataclass(frozen=True)
class TensorItem:
    """A live tensor, described for storage without copying it.

    Attributes:
        key: unique key within the snapshot file.
        tensor: the live tensor (any device; contiguous).
        attrs: JSON-able attributes stored in the footer (VPS key, region, ...).
    """

    key: str
    tensor: torch.Tensor
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.tensor.is_contiguous():
            raise ValueError(f"{self.key}: tensor items must be contiguous")

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def dtype(self) -> str:
        return str(self.tensor.dtype).replace("torch.", "")

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.tensor.shape)

    def byte_view(self) -> torch.Tensor:
        """A ``torch.uint8`` view of the tensor's bytes (no copy; same device)."""
        return self.tensor.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class ObjectItem:
    """Serialized plain data (allow-listed JSON bytes)."""

    key: str
    payload: bytes
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.payload)


Item = Any  # TensorItem | ObjectItem


class StateProvider(Protocol):
    """Turns live state into items and back (see the module docstring for the call order)."""

    def items(self) -> Iterator[Item]: ...

    def restore(self, items: Mapping[str, Any]) -> Any: ...


class DictStateProvider:
    """A nested state dict (what DeepSpeed hands a checkpoint engine): its plain data become one
    object item (``__skeleton__``) and each tensor a tensor item ``t/<index>``.

    Args:
        state: the nested dict.
        tensor_attrs: optional attributes for tensors, a mapping ``path -> attrs`` or a callable
            ``path -> attrs``, where path is the key path in the dict
            (``"optimizer_state_dict/single_partition_of_fp32_groups/0"``); the elastic engine
            uses it to attach each ZeRO partition's VPS fragments.

    Raises:
        UnrepresentableError: a value cannot be represented (names its key path).
    """

    def __init__(self, state: Any, tensor_attrs: Optional[Mapping[str, Mapping[str, Any]]] = None):
        payload, tensors = dumps(state)
        self._payload = payload
        self._tensors = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
        self._paths = list(tensors.paths)
        if tensor_attrs is None:
            self._attrs_of = lambda path: {}
        elif callable(tensor_attrs):
            self._attrs_of = tensor_attrs
        else:
            self._attrs_of = lambda path, m=dict(tensor_attrs): m.get(path, {})

    def items(self) -> Iterator[Item]:
        yield ObjectItem(SKELETON, self._payload)
        for i, t in enumerate(self._tensors):
            path = self._paths[i]
            yield TensorItem(f"t/{i}", t, {"path": path, **(self._attrs_of(path) or {})})

    @staticmethod
    def rebuild(items: Mapping[str, Any]) -> Any:
        """The state dict back from items read from a file (``key -> tensor or bytes``)."""
        payload = items[SKELETON]
        return loads(bytes(payload), lambda i: items[f"t/{i}"], key=SKELETON)

    def restore(self, items: Mapping[str, Any]) -> Any:
        return self.rebuild(items)


class CompositeProvider:
    """Children under key prefixes (``"<prefix>/<child key>"``), in the given order."""

    def __init__(self, children: Sequence[Tuple[str, StateProvider]]):
        prefixes = [p for p, _ in children]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"duplicate provider prefixes: {prefixes}")
        self.children = list(children)

    def items(self) -> Iterator[Item]:
        for prefix, child in self.children:
            for it in child.items():
                if isinstance(it, TensorItem):
                    yield TensorItem(f"{prefix}/{it.key}", it.tensor, it.attrs)
                else:
                    yield ObjectItem(f"{prefix}/{it.key}", it.payload, it.attrs)

    def restore(self, items: Mapping[str, Any]) -> Dict[str, Any]:
        out = {}
        for prefix, child in self.children:
            sub = {k[len(prefix) + 1 :]: v for k, v in items.items() if k.startswith(prefix + "/")}
            out[prefix] = child.restore(sub)
        return out


class RNGStateProvider:
    """This process's random number generators (torch CPU, Python, numpy): one object item."""

    def items(self) -> Iterator[Item]:
        import random

        import numpy as np

        payload, tensors = dumps(
            {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        )
        yield ObjectItem("rng", payload)
        for i, t in enumerate(tensors):
            yield TensorItem(f"rng/t/{i}", t.contiguous())

    def restore(self, items: Mapping[str, Any]) -> None:
        import random

        import numpy as np

        state = loads(bytes(items["rng"]), lambda i: items[f"rng/t/{i}"], key="rng")
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
