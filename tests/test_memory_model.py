"""The memory model (ulysses_mcore.planning.memory_model) against counts made here by hand: what
Ulysses divides, the bytes the all-to-alls move, and the budget search.  (Its constants are fitted
to measured step peaks by tools/bench_step_memory.py: docs/memory.md.)"""

import pytest

from ulysses_mcore.planning.memory_model import estimate, longest_sequence

LLAMA8B = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=128256,
    bf16=True,
    swiglu=True,
)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_activations_and_logits_fall_by_the_degree_states_do_not(P):
    one, sharded = estimate(seq_length=131072, **LLAMA8B), estimate(seq_length=131072, ulysses=P, **LLAMA8B)
    for key in ("activations_bytes", "loss_transient_bytes"):
        assert sharded[key] == pytest.approx(one[key] / P)
    for key in ("weights_bytes", "grads_bytes", "optimizer_bytes", "params_per_rank"):
        assert sharded[key] == one[key]
    assert sharded["tokens_per_rank"] == 131072 // P


def test_all_to_all_bytes_are_the_shards_that_leave_the_rank():
    """Forward and backward, (P-1)/P of the local q, k, v (kv heads >= P) and output shards."""
    P, s, b, d = 4, 8192, 2, 4096 // 32
    est = estimate(seq_length=s, micro_batch_size=b, ulysses=P, **LLAMA8B)
    local = s // P * b * d * 2  # tokens x batch x head dim x bf16 bytes, per head
    per_layer = 2 * (P - 1) / P * local * (32 + 8 + 8 + 32)
    assert est["a2a_bytes_per_layer"] == pytest.approx(per_layer)
    assert est["a2a_bytes_per_step"] == pytest.approx(per_layer * 32)
    assert estimate(seq_length=s, micro_batch_size=b, **LLAMA8B)["a2a_bytes_per_layer"] == 0


def test_longest_sequence_fits_and_one_step_more_does_not():
    budget, step, kw = 140e9, 16, dict(LLAMA8B, tp=2, ulysses=8)
    s = longest_sequence(budget, step, **kw)
    assert s > 100_000 and s % step == 0
    assert estimate(seq_length=s, **kw)["total_bytes"] <= budget
    assert estimate(seq_length=s + step, **kw)["total_bytes"] > budget
    assert longest_sequence(1e9, step, **kw) == 0  # the states alone exceed 1 GB


def test_bf16_gradient_reduction_halves_the_gradient_buffer_only():
    """--grad-reduce-in-bf16 with --bf16: DDP's buffer at 2 bytes a parameter; without bf16 weights it
    changes nothing (Megatron keeps fp32 gradients of fp32 weights)."""
    fp32_grads, bf16_grads = estimate(**LLAMA8B), estimate(grad_reduce_in_bf16=True, **LLAMA8B)
    assert bf16_grads["grads_bytes"] == pytest.approx(fp32_grads["grads_bytes"] / 2)
    assert bf16_grads["grads_bytes"] == pytest.approx(2 * fp32_grads["params_per_rank"])
    for key in ("weights_bytes", "optimizer_bytes", "activations_bytes"):
        assert bf16_grads[key] == fp32_grads[key]
    fp32 = dict(LLAMA8B, bf16=False)
    assert estimate(grad_reduce_in_bf16=True, **fp32)["grads_bytes"] == estimate(**fp32)["grads_bytes"]


def test_linear_biases_weigh_one_residual_tensor_in_the_recomputed_layer_at_ulysses_1():
    """Under full recompute at ulysses 1 the recomputed layer peaks at the MLP's bias-dropout-add, where
    the output plus its bias is one [s, h] more (the dry run); elsewhere the biases weigh nothing here."""
    s, full = 65536, dict(LLAMA8B, recompute="full", mlp_chunk_tokens=4096, offload=True)
    for u, less in ((1, s * 4096 * 2), (4, 0)):
        biased, unbiased = (estimate(seq_length=s, ulysses=u, bias_linear=b, **full) for b in (True, False))
        assert biased["activations_bytes"] - unbiased["activations_bytes"] == pytest.approx(less / u)
    plain = (estimate(seq_length=s, bias_linear=b, **LLAMA8B)["activations_bytes"] for b in (True, False))
    assert len(set(plain)) == 1  # without recompute the layer's saved tensors are the same either way


def test_unknown_inputs_are_refused():
    with pytest.raises(TypeError, match="num_layer"):
        estimate(num_layer=2, hidden_size=64, num_attention_heads=4)


def test_qk_norms_keep_the_qkv_projection_in_the_recomputed_layer():
    """--qk-layernorm's norms save views of the packed QKV projection, so it stays through the
    recomputed layer's backward: at ulysses 1 the kernel's own copy of v frees nothing, at ulysses > 1
    the all-to-all's copies do not free it (the dry run of Qwen3-4B at tp 2 x ulysses 2)."""
    s, full = 65536, dict(LLAMA8B, recompute="full", mlp_chunk_tokens=4096, offload=True, bf16=True)
    hq, hk, d = 32, 8, 128
    for u, more in ((1, (hq + hk) * d), (4, (hq + 2 * hk) * d)):
        plain, normed = (estimate(seq_length=s, ulysses=u, qk_layernorm=q, **full) for q in (False, True))
        assert normed["activations_bytes"] - plain["activations_bytes"] == pytest.approx(2 * s / u * more)
