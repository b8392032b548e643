"""ulysses-mcore: Ulysses sequence parallelism (all-to-all attention) for Megatron-Core.

Names are imported lazily, so ``ulysses_mcore.topology`` (pure rank math) loads without
torch.distributed or Megatron-Core.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ulysses_attention": "attention",
    "UlyssesAttention": "attention",
    "new_sequence_groups": "attention",
    "HeadPlan": "comm",
    "seq_to_head": "comm",
    "head_to_seq": "comm",
    "get_ulysses_group": "state",
    "set_ulysses_group": "state",
    "Topology": "topology",
    "TopologyError": "topology",
    "initialize": "megatron.groups",
    "get_ulysses_layer_spec": "megatron.specs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ulysses_mcore' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
