"""State providers: live training state as an ordered stream of items with VPS coordinates, and back.

Knows nothing of storage (that is ``io_engine``) and nothing of DeepSpeed engine internals beyond
the objects it is handed.
"""

from .providers import (
    SKELETON,
    CompositeProvider,
    DictStateProvider,
    ObjectItem,
    RNGStateProvider,
    StateProvider,
    TensorItem,
)
from .serialize import DecodeError, UnrepresentableError, allow_class, dumps, loads

__all__ = [
    "TensorItem",
    "ObjectItem",
    "StateProvider",
    "DictStateProvider",
    "CompositeProvider",
    "RNGStateProvider",
    "SKELETON",
    "UnrepresentableError",
    "DecodeError",
    "allow_class",
    "dumps",
    "loads",
]
