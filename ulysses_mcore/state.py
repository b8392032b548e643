"""The Ulysses and ring process groups registered for this process (set by :func:`ulysses_mcore.initialize`).

Only the group lives here; head counts and everything model-specific live on module
instances (a second model in the same process must not inherit the first one's heads).
"""

from __future__ import annotations

_ULYSSES_GROUP = None


def set_ulysses_group(group) -> None:
    global _ULYSSES_GROUP
    _ULYSSES_GROUP = group


def get_ulysses_group():
    """The registered Ulysses group, or ``None`` (degree 1)."""
    return _ULYSSES_GROUP


_RING_GROUP = None


def set_ring_group(group) -> None:
    global _RING_GROUP
    _RING_GROUP = group


def get_ring_group():
    """The registered ring context-parallel group, or ``None`` (no ring)."""
    return _RING_GROUP
