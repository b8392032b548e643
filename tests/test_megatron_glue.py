"""Tier 1-2: batch sharding, layer specs and the CPU shims, without spawning processes."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ulysses_mcore.megatron import batch as B


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_shards_reassemble_and_keep_shifted_labels(b, S, degree, lb):
    text = torch.randint(0, 100, (b, S + 1))
    full = B.make_lm_batch(text)
    mult = degree * (2 if lb else 1)
    padded = B.pad_batch(full, mult, pad_token_id=-1)
    assert padded["tokens"].shape[1] % mult == 0
    shards = [
        B.shard_batch(full, rank=r, degree=degree, load_balanced=lb, pad_to_multiple_of=mult, pad_token_id=-1)
        for r in range(degree)
    ]
    # every (token, label, position) triple of the full batch appears exactly once
    seen = {}
    for s in shards:
        for t, lab, p, m in zip(
            s["tokens"].flatten().tolist(),
            s["labels"].flatten().tolist(),
            s["position_ids"].flatten().tolist(),
            s["loss_mask"].flatten().tolist(),
        ):
            seen.setdefault(p, []).append((t, lab, m))
    for p in range(S):
        tokens_at_p = list(seen[p])
        assert len(tokens_at_p) == b
        assert sorted(tokens_at_p) == sorted(zip(text[:, p].tolist(), text[:, p + 1].tolist(), [1.0] * b))
    for p in range(S, padded["tokens"].shape[1]):
        assert all(m == 0.0 for _, _, m in seen[p])  # padding is masked out of the loss


def test_last_token_of_a_shard_keeps_its_label():
    text = torch.arange(17).unsqueeze(0)  # tokens 0..15, labels 1..16
    s0 = B.shard_batch(B.make_lm_batch(text), rank=0, degree=2, load_balanced=False)
    assert s0["tokens"][0, -1].item() == 7 and s0["labels"][0, -1].item() == 8  # 8 lives on shard 1
    lb = B.shard_batch(B.make_lm_batch(text), rank=1, degree=2, load_balanced=True)
    assert lb["tokens"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    assert lb["position_ids"][0].tolist() == list(range(4, 12))


def test_indivisible_length_names_the_fix():
    full = B.make_lm_batch(torch.zeros(1, 31, dtype=torch.long))
    with pytest.raises(ValueError, match="pad_to_multiple_of=8"):
        B.shard_batch(full, rank=0, degree=4, load_balanced=True)


def test_padding_masks_attention_mask_keys():
    full = B.make_lm_batch(torch.zeros(2, 7, dtype=torch.long))
    full["attention_mask"] = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    out = B.pad_batch(full, 4)
    m = out["attention_mask"]
    assert m.shape == (2, 1, 8, 8) and m[..., 6:].all() and not m[..., :6, :6].any()


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
    from ulysses_mcore.megatron.specs import swap_core_attention

    base = get_gpt_layer_local_spec()
    wrapped = ModuleSpec(module=object, submodules=functools.partial(dict, layer=base))
    out = swap_core_attention(wrapped)
    inner = out.submodules.keywords["layer"]
    assert inner.submodules.self_attention.submodules.core_attention.module is UlyssesAttention
    assert wrapped.submodules.keywords["layer"] is base  # the input is not modified


def test_spec_swap_keeps_everything_else():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ulysses_mcore import UlyssesAttention
    from ulysses_mcore.megatron.specs import get_ulysses_layer_spec, swap_core_attention

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


def test_cpu_compat_applies_without_cuda_and_removes_cleanly(monkeypatch):
    import megatron.core.tensor_parallel.random as mrandom

    from ulysses_mcore.megatron import cpu_compat

    before = (torch.cuda.current_device, torch.cuda.get_rng_state, mrandom._set_cuda_rng_state)
    assert cpu_compat.apply() is True and cpu_compat.active()
    try:
        assert torch.cuda.current_device() == "cpu"
        t = torch.empty(3, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, pin_memory=True).device.type == "cpu"
        # the RNG tracker's state is torch's CPU generator
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        tr = CudaRNGStatesTracker()
        tr.add("x", 7)
        outside = torch.get_rng_state()
        with tr.fork("x"):
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outside)
        tr2 = CudaRNGStatesTracker()
        tr2.add("x", 7)
        with tr2.fork("x"):
            assert torch.equal(torch.rand(3), a)
    finally:
        cpu_compat.remove()
    assert not cpu_compat.active()
    assert (torch.cuda.current_device, torch.cuda.get_rng_state, mrandom._set_cuda_rng_state) == before
    assert torch.zeros(2).type() == "torch.FloatTensor"
    # with CUDA present the shims stay off
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() is False and not cpu_compat.active()
