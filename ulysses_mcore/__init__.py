"""ulysses-mcore: Ulysses sequence parallelism (all-to-all attention) for Megatron-Core.

Layers: the core (``attention``, ``call``, ``options``, ``topology`` and the ``exchange``,
``kernels`` and ``validation`` rooms) imports torch only; the Megatron adapter is
:mod:`ulysses_mcore.megatron`.  Names are imported lazily, so ``import ulysses_mcore`` and the
functional API never import Megatron-Core; ``UlyssesAttention``, ``initialize`` and
``get_ulysses_layer_spec`` load the adapter when first used.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ulysses_attention": "attention",
    "UlyssesAttention": "megatron.layer.module",
    "new_sequence_groups": "attention",
    "release": "attention",
    "HeadPlan": "exchange.heads",
    "seq_to_head": "exchange.pair",
    "head_to_seq": "exchange.pair",
    "get_ulysses_group": "megatron.layer.groups",
    "Topology": "topology",
    "TopologyError": "topology",
    "initialize": "megatron.layer.groups",
    "get_ulysses_layer_spec": "megatron.layer.specs",
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
