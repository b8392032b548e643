"""ulysses_mcore.state: the one registry of this process's sequence-parallel groups."""

from ulysses_mcore import state


def test_register_and_clear():
    try:
        g, r = object(), object()
        state.register(g, r, "topo")
        assert state.get_ulysses_group() is g and state.get_ring_group() is r and state.get_topology() == "topo"
        state.set_ulysses_group(None)
        assert state.get_ulysses_group() is None and state.get_ring_group() is r
    finally:
        state.clear()
    assert (state.get_ulysses_group(), state.get_ring_group(), state.get_topology()) == (None, None, None)
