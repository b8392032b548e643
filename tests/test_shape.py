"""The model-shape record (ulysses_mcore.planning.shape): Megatron's defaults, the flags it writes
back, and the same numbers in every reader (the memory model, the step-time model, the placement)."""

import argparse

import pytest

from ulysses_mcore.planning.memory_model import estimate
from ulysses_mcore.planning.placement import Costs
from ulysses_mcore.planning.shape import MODELS, ModelShape, model_named
from ulysses_mcore.planning.step_time import Run, features
from ulysses_mcore.topology import Topology


def test_megatron_defaults_fill_what_the_flags_leave_out():
    plain = ModelShape(num_layers=2, hidden_size=768, num_attention_heads=12)
    assert (plain.num_query_groups, plain.ffn_hidden_size, plain.head_dim, plain.kv_hidden) == (12, 3072, 64, 768)
    glu = ModelShape(num_layers=2, hidden_size=768, num_attention_heads=12, num_query_groups=4, swiglu=True)
    # Megatron-LM's rule for SwiGLU: 2/3 of 4h, rounded down to a multiple of 64
    assert glu.ffn_hidden_size == 2048 and glu.kv_hidden == 256


def test_from_args_reads_megatron_names_and_round_trips_through_the_flags():
    args = argparse.Namespace(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=384,
        vocab_size=384,
        swiglu=False,
    )
    shape = ModelShape.from_args(args)
    assert shape == MODELS["tiny"]
    assert ModelShape.from_args(args, vocab_size=512).vocab_size == 512
    flags = shape.flags()
    back = dict(zip(flags[::2], flags[1::2])) if "--group-query-attention" not in flags else None
    assert back is None and flags[flags.index("--num-query-groups") + 1] == "4" and "--swiglu" not in flags
    assert "--swiglu" in MODELS["llama8b"].flags()


def test_an_unknown_preset_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"--model 'gpt5' is unknown: use one of \['llama70b', 'llama8b', 'tiny'\]"):
        model_named("gpt5")
    with pytest.raises(ValueError, match="--model 'gpt5'"):
        _ = Run("gpt5").shape


def test_every_reader_sees_the_same_shape():
    """The memory model's parameters, the step-time model's MLP FLOPs and the placement's per-token
    MLP FLOPs, each from the one record, against the formulas written out here."""
    m = MODELS["llama8b"]
    h, f, L, V, kv = m.hidden_size, m.ffn_hidden_size, m.num_layers, m.vocab_size, m.kv_hidden
    params = L * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + 2 * V * h + h
    assert estimate(**m.keywords())["params_per_rank"] == pytest.approx(params, rel=1e-3)
    run = Run(m, seq_length=1024, micro_batch_size=1, global_batch_size=1)
    assert features(run, Topology.of())["mlp_flops"] == pytest.approx(3 * 2 * 1024 * h * f * 3 * L)
    assert Costs.from_rates({"mlp": {"mlp_flops": 1.0}, "attention": {"attn_flops": 0.0}}, m).token == 6 * L * 3 * h * f


def test_kv_channels_set_the_head_width_everywhere():
    """Qwen3-4B: 32 heads of 128 channels over a hidden size of 2560 (--kv-channels 128)."""
    qwen = ModelShape(36, 2560, 32, 8, 9728, 151936, True, kv_channels=128)
    assert qwen.head_dim == 128 and qwen.kv_hidden == 8 * 128
    assert qwen.work()["projections"] == 2 * (2560 * (32 * 128 + 2 * 1024) + 32 * 128 * 2560)
    assert "--kv-channels" in qwen.flags()
    wide, narrow = estimate(**qwen.keywords()), estimate(**(qwen.keywords() | {"kv_channels": None}))
    per_layer = 2560 * (32 + 16) * (128 - 80) + (32 + 16) * (128 - 80) + 32 * (128 - 80) * 2560
    assert wide["params_per_rank"] - narrow["params_per_rank"] == 36 * per_layer
