"""ulysses_mcore.megatron.layer.specs: core attention swapped through ModuleSpec, everything else kept."""

import pytest


def _same(a, b):
    """Structural equality that sees through functools.partial (compared by identity)."""
    import functools

    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (
            a.func == b.func
            and len(a.args) == len(b.args)
            and all(map(_same, a.args, b.args))
            and a.keywords.keys() == b.keywords.keys()
            and all(_same(a.keywords[k], b.keywords[k]) for k in a.keywords)
        )
    return a == b


def test_spec_swap_looks_inside_partials():
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ulysses_mcore import UlyssesAttention
    from ulysses_mcore.megatron.layer.specs import swap_core_attention

    base = get_gpt_layer_local_spec()
    wrapped = ModuleSpec(module=object, submodules=functools.partial(dict, layer=base))
    out = swap_core_attention(wrapped)
    inner = out.submodules.keywords["layer"]
    assert inner.submodules.self_attention.submodules.core_attention.module is UlyssesAttention
    assert wrapped.submodules.keywords["layer"] is base  # the input is not modified


def test_spec_swap_keeps_everything_else():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ulysses_mcore import UlyssesAttention
    from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec, swap_core_attention

    base = get_gpt_layer_local_spec(qk_layernorm=True)
    spec = get_ulysses_layer_spec(qk_layernorm=True)
    sa, sa0 = spec.submodules.self_attention.submodules, base.submodules.self_attention.submodules
    assert sa.core_attention.module is UlyssesAttention and sa.core_attention.params == {"backend": "sdpa"}
    assert sa.q_layernorm == sa0.q_layernorm and sa.linear_qkv == sa0.linear_qkv
    assert _same(spec.submodules.mlp, base.submodules.mlp)  # a partial in megatron-core 0.19
    assert base.submodules.self_attention.submodules.core_attention is not UlyssesAttention  # copy, not in place
    swapped = swap_core_attention(base)
    assert swapped.submodules.mlp is base.submodules.mlp  # untouched parts are the very objects
    assert swapped.submodules.self_attention is not base.submodules.self_attention
    moe = get_ulysses_layer_spec(num_experts=4)
    assert moe.submodules.self_attention.submodules.core_attention.module is UlyssesAttention
    assert "MoE" in repr(moe.submodules.mlp)  # a ModuleSpec (0.16) or a partial (0.19) of MoELayer
    with pytest.raises(ValueError, match="no self-attention"):
        swap_core_attention(base.submodules.mlp)
    with pytest.raises(ValueError, match="base='gpu'"):
        get_ulysses_layer_spec("gpu")
