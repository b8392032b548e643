"""The trainer's model (ulysses_mcore.megatron.trainer.model): the TransformerConfig its flags give,
against Megatron-LM's own rules written out here (SwiGLU's width, the activation, recompute)."""

import torch

from ulysses_mcore.megatron.trainer.model import _config_of
from ulysses_mcore.megatron.trainer.parser import build_parser

BASE = ["--num-layers", "2", "--hidden-size", "768", "--num-attention-heads", "12"]


def test_megatron_lm_defaults_for_the_mlp():
    plain = _config_of(build_parser().parse_args(BASE))
    assert plain["ffn_hidden_size"] == 4 * 768 and plain["activation_func"] is torch.nn.functional.gelu
    glu = _config_of(build_parser().parse_args(BASE + ["--swiglu"]))
    # Megatron-LM: ffn_hidden_size = int((4 * hidden * 2 / 3) / 64) * 64 under --swiglu
    assert glu["ffn_hidden_size"] == 2048 and glu["gated_linear_unit"]
    assert glu["activation_func"] is torch.nn.functional.silu
    given = _config_of(build_parser().parse_args(BASE + ["--swiglu", "--ffn-hidden-size", "1000"]))
    assert given["ffn_hidden_size"] == 1000


def test_full_recompute_is_megatron_uniform_one_layer_and_bf16_sets_the_dtype():
    c = _config_of(build_parser().parse_args(BASE + ["--recompute-granularity", "full", "--bf16"]))
    assert (c["recompute_method"], c["recompute_num_layers"]) == ("uniform", 1)
    assert c["bf16"] and c["params_dtype"] is torch.bfloat16
    c = _config_of(build_parser().parse_args(BASE))
    assert c.get("recompute_method") is None and c["params_dtype"] is torch.float32
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"]
    c = _config_of(build_parser().parse_args(BASE + flags))
    assert (c["recompute_method"], c["recompute_num_layers"]) == ("block", 3)


def test_memory_flags_reach_megatrons_configs():
    """The DDP wrapper's settings and MoE / offloading keywords are Megatron-LM's for the same flags."""
    from ulysses_mcore.megatron.trainer.model import _memory_of

    args = build_parser().parse_args(BASE + ["--num-experts", "8", "--expert-model-parallel-size", "2"])
    m = _memory_of(args)
    assert (m["num_moe_experts"], m["expert_model_parallel_size"], m["moe_router_topk"]) == (8, 2, 2)
    assert m["moe_token_dispatcher_type"] == "alltoall"
    args = build_parser().parse_args(BASE + ["--fine-grained-activation-offloading", "--offload-modules", "core_attn"])
    assert _memory_of(args) == dict(fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    assert _memory_of(build_parser().parse_args(BASE)) == {}
