"""The one registry of this process's sequence-parallel groups.

:func:`ulysses_mcore.initialize` and the Megatron-LM patches (``megatron_patches``) both fill
it through :func:`register`; everything else reads it (``UlyssesAttention`` only when Megatron
hands it no ``pg_collection``).  Only groups and degrees live here: head counts and everything
model-specific live on module instances (a second model must not inherit the first's heads).
Torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class _Registry:
    ulysses_group: Any = None  # None: degree 1
    ring_group: Any = None  # None: no ring
    topology: Any = None  # a ulysses_mcore.Topology, when the builder knew the whole world
    pg_collection: Any = None  # cached Megatron ProcessGroupCollection (the adapter fills it)


_REG = _Registry()


def register(ulysses_group=None, ring_group=None, topology=None) -> None:
    """Record this rank's Ulysses and ring groups (``None`` for an axis of size 1)."""
    _REG.ulysses_group, _REG.ring_group, _REG.topology = ulysses_group, ring_group, topology
    _REG.pg_collection = None


def clear() -> None:
    """Forget every group (Megatron's parallel_state is the caller's to destroy)."""
    register(None, None, None)


def registry() -> _Registry:
    return _REG


def set_ulysses_group(group) -> None:
    """Register ``group`` as the Ulysses group (functional use without :func:`ulysses_mcore.initialize`)."""
    _REG.ulysses_group = group
    _REG.pg_collection = None


def get_ulysses_group():
    """The registered Ulysses group, or ``None`` (degree 1)."""
    return _REG.ulysses_group


def get_ring_group():
    """The registered ring context-parallel group, or ``None`` (no ring)."""
    return _REG.ring_group


def get_topology() -> Optional[Any]:
    return _REG.topology
