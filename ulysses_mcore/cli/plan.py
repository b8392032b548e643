"""``ulysses-mcore plan``: per-rank memory and all-to-all bytes of a Ulysses GPT, and the longest
sequence that fits a budget (the model: :mod:`ulysses_mcore.planning.memory_model`)."""

from __future__ import annotations

import argparse
import json

from ..planning.memory_model import __doc__ as MODEL_DOC
from ..planning.memory_model import estimate, longest_sequence
from ..devtools.flags import explain
from ..planning.calibration import Calibration, CalibrationError
from ..planning.shape import ModelShape
from ..planning.longest import Choices, Cluster, dryrun_command, longest
from ..planning.step_time import PRESETS, Run, predict
from ..topology import Topology


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ulysses-mcore plan", description=MODEL_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--grad-reduce-in-bf16", action="store_true")
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--recompute", choices=["full"], default=None)
    p.add_argument(
        "--torch-adam",
        action="store_true",
        help="torch's foreach Adam (CPU, or no TE/Apex): its step's temporaries count (fused Adam's do not)",
    )
    p.add_argument("--loss-chunk-tokens", type=int, default=None)
    p.add_argument("--mlp-chunk-tokens", type=int, default=None)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (for the distributed optimizer)")
    p.add_argument("--budget-gb", type=float)
    p.add_argument("--calibration", default=None)
    p.add_argument("--json", action="store_true")
    g = p.add_argument_group("--longest: the longest sequence a cluster trains (Megatron-LM's model flags)")
    g.add_argument("--longest", action="store_true")
    g.add_argument("--preset", choices=sorted(PRESETS), default="h100")
    g.add_argument("--world-size", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default=None)
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--qk-layernorm", action="store_true")
    explain(p, PLAN_HELP)
    return p


PLAN_HELP = {
    "--num-layers": "transformer layers",
    "--hidden-size": "hidden size",
    "--num-attention-heads": "query heads",
    "--num-query-groups": "key/value heads (grouped-query attention; default: the query heads)",
    "--ffn-hidden-size": "MLP hidden size (default: 4 x hidden)",
    "--vocab-size": "vocabulary (default: %(default)s)",
    "--seq-length": "tokens per sample (default: %(default)s)",
    "--micro-batch-size": "samples per micro-batch (default: %(default)s)",
    "--tp": "tensor-parallel ranks (default: %(default)s)",
    "--ulysses": "Ulysses degree (default: %(default)s)",
    "--cp": "ring context-parallel ranks (default: %(default)s)",
    "--pp": "pipeline stages (default: %(default)s)",
    "--bf16": "bf16 weights and activations (fp32 gradients, master weights, Adam state)",
    "--grad-reduce-in-bf16": "with --bf16 (or --longest): DDP's gradients kept and summed in bf16 -- half the "
    "gradient buffer, sums rounded to bf16 (Megatron-LM's opt-in)",
    "--swiglu": "SwiGLU MLP (fc1 twice as wide)",
    "--recompute": "full activation recompute (only each layer's input kept)",
    "--loss-chunk-tokens": "the chunked loss's tokens per chunk (only one chunk's logits live)",
    "--mlp-chunk-tokens": "the sequence-tiled MLP's tokens per tile",
    "--use-distributed-optimizer": "Adam state sharded over dp x ulysses x cp",
    "--budget-gb": "also print, per degree, the longest sequence whose step peak fits this many GB",
    "--calibration": "with --budget-gb: each longest sequence's tokens/s per GPU by this calibration "
    "(`ulysses-mcore fit --out DIR`'s DIR/calibration.json)",
    "--json": "print the estimate as JSON",
    "--longest": "the longest --seq-length that fits --world-size GPUs of --preset (8%% of each GPU's memory left "
    "to the allocator), over every layout and with every memory feature; its last line is the dry run that checks it",
    "--preset": "the GPU of --longest (default: %(default)s)",
    "--world-size": "GPUs of --longest",
    "--group-query-attention": "grouped-query attention with --num-query-groups KV heads (Megatron-LM's flag)",
    "--normalization": "LayerNorm or RMSNorm (passed to the dry run's command)",
    "--untie-embeddings-and-output-weights": "a separate output layer (passed to the dry run's command)",
    "--position-embedding-type": "rope or learned_absolute (passed to the dry run's command)",
    "--disable-bias-linear": "no linear biases (passed to the dry run's command)",
    "--kv-channels": "channels of each head (default: hidden / heads)",
    "--qk-layernorm": "per-head query and key norms (passed to the dry run's command)",
}


def _model_keywords(a) -> dict:
    """The memory model's keywords of the flags (all but the sequence and the degree): the model's
    shape (:class:`~ulysses_mcore.planning.shape.ModelShape`, Megatron's defaults) and the run's."""
    return dict(
        **ModelShape.from_args(a).keywords(),
        micro_batch_size=a.micro_batch_size,
        tp=a.tp,
        cp=a.cp,
        pp=a.pp,
        bf16=a.bf16,
        recompute=a.recompute,
        distributed_optimizer=a.use_distributed_optimizer,
        dp=a.dp,
        loss_chunk_tokens=a.loss_chunk_tokens,
        mlp_chunk_tokens=a.mlp_chunk_tokens,
        torch_adam=a.torch_adam,
        grad_reduce_in_bf16=a.grad_reduce_in_bf16,
        bias_linear=not a.disable_bias_linear,
    )


def _print(a, est: dict, out: dict) -> None:
    gb = 1e9
    print(f"per rank at seq {a.seq_length}, tp {a.tp} x ulysses {a.ulysses} x cp {a.cp} x pp {a.pp}:")
    print(
        f"  weights {est['weights_bytes'] / gb:.2f} GB, grads {est['grads_bytes'] / gb:.2f} GB, "
        f"Adam {est['optimizer_bytes'] / gb:.2f} GB, activations {est['activations_bytes'] / gb:.2f} GB, "
        f"logits {est['loss_transient_bytes'] / gb:.2f} GB -> step peak {est['total_bytes'] / gb:.2f} GB"
    )
    print(
        f"  tokens per rank {est['tokens_per_rank']}; all-to-all sent per rank: "
        f"{est['a2a_bytes_per_layer'] / 1e6:.1f} MB per layer, {est['a2a_bytes_per_step'] / gb:.2f} GB per micro-batch"
        + (f"; ring shifts {est['ring_bytes_per_layer'] / 1e6:.1f} MB per layer" if a.cp > 1 else "")
    )
    if a.budget_gb:
        print(f"longest sequence in {a.budget_gb} GB per rank:")
        speed = out.get("tokens_per_s_per_gpu", {})
        for ulysses, s in out["longest_sequence"].items():
            fast = f"; {speed[ulysses][0]:.0f} tokens/s per GPU, {speed[ulysses][1]}" if ulysses in speed else ""
            print(f"  ulysses {ulysses:2d}: {s:>10d} tokens" + (fast if s else "  (does not fit)"))


def _speeds(a, longest: dict) -> dict:
    """{degree: (tokens/s per GPU at its longest sequence by ``--calibration``, how far that reaches)}:
    one micro-batch a rank, the layout of the flags at that degree."""
    try:
        cal = Calibration.load(a.calibration)
    except CalibrationError as e:
        raise SystemExit(f"error: {e}") from None
    out = {}
    for ulysses, seq in longest.items():
        if not seq:
            continue
        lay = Topology.of(a.tp, ulysses, a.cp, a.pp, a.dp)
        run = Run(ModelShape.from_args(a), seq, a.micro_batch_size, a.micro_batch_size * a.dp, bf16=a.bf16)
        run.recompute, run.distributed_optimizer = a.recompute, a.use_distributed_optimizer
        step = predict(cal.rates, run, lay)["step_s"]
        out[ulysses] = (run.global_batch_size * seq / step / lay.world_size, cal.reach_text(seq, lay.world_size))
    return out


def _model_flags(a) -> list:
    """The trainer's model flags of the parsed ones (Megatron-LM's names), for the dry run's command."""
    out = ["--num-layers", a.num_layers, "--hidden-size", a.hidden_size, "--num-attention-heads", a.num_attention_heads]
    if a.num_query_groups or a.group_query_attention:
        out += ["--group-query-attention", "--num-query-groups", a.num_query_groups or 1]
    out += ["--ffn-hidden-size", a.ffn_hidden_size] if a.ffn_hidden_size else []
    out += ["--swiglu"] if a.swiglu else []
    out += ["--normalization", a.normalization] if a.normalization else []
    out += ["--position-embedding-type", a.position_embedding_type] if a.position_embedding_type else []
    out += ["--untie-embeddings-and-output-weights"] if a.untie_embeddings_and_output_weights else []
    out += ["--disable-bias-linear"] if a.disable_bias_linear else []
    out += ["--kv-channels", a.kv_channels] if a.kv_channels else []
    out += ["--qk-layernorm"] if a.qk_layernorm else []
    return [str(x) for x in out] + ["--vocab-size", str(a.vocab_size)]


def _longest(a) -> int:
    """``--longest``: the plan, runners-up, and the dry run's command on the last line."""
    if not a.world_size or a.world_size < 1:
        raise SystemExit("error: plan --longest needs --world-size N (the GPUs of the cluster), e.g. --world-size 8")
    if a.group_query_attention and a.num_query_groups is None:
        a.num_query_groups = 1  # Megatron-LM's default
    cluster = Cluster(a.world_size, a.preset)
    choices = Choices(
        tied=not a.untie_embeddings_and_output_weights,
        bf16_grads=a.grad_reduce_in_bf16,
        biases=not a.disable_bias_linear,
    )
    plans = longest(ModelShape.from_args(a), cluster, choices)
    if not plans or not plans[0].seq_length:
        raise SystemExit(
            f"error: no layout of {a.world_size} x {a.preset} fits this model in {cluster.budget_bytes / 1e9:.1f} GB "
            "a GPU even at the shortest sequence: add GPUs"
        )
    best = plans[0]
    e = {k: v / 1e9 for k, v in best.estimate.items() if k.endswith("_bytes")}
    print(
        f"longest sequence on {a.world_size} x {a.preset} ({cluster.memory_gb:g} GB, {cluster.headroom:.0%} left to the "
        f"allocator: {cluster.budget_bytes / 1e9:.1f} GB a GPU): {best.seq_length:,} tokens"
    )
    print(f"  layout: {_words(best.layout)}; {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU predicted")
    print(f"  memory flags: {' '.join(choices.flags)}")
    print(
        f"  planned peak {e['total_bytes']:.1f} GB a GPU: weights {e['weights_bytes']:.1f}, gradients "
        f"{e['grads_bytes']:.1f}, activations {e['activations_bytes']:.1f}, step transients "
        f"{e['step_transient_bytes'] - e['activations_bytes']:.1f}; host memory {best.host_gb_per_node:,.0f} GB a node "
        "(offloaded layer inputs and optimizer state)"
    )
    for p in plans[1:4]:
        print(f"  then: {_words(p.layout)}: {p.seq_length:,} tokens, {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    print(dryrun_command(_model_flags(a), best, cluster, choices))
    return 0


def _words(lay) -> str:
    return f"tp {lay.tp} x ulysses {lay.ulysses} x cp {lay.cp} x pp {lay.pp} x dp {lay.dp}"


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.grad_reduce_in_bf16 and not (a.bf16 or a.longest):
        raise SystemExit("error: --grad-reduce-in-bf16 keeps bf16 gradients of bf16 weights: add --bf16")
    if a.longest:
        return _longest(a)
    kw = _model_keywords(a)
    est = estimate(seq_length=a.seq_length, ulysses=a.ulysses, **kw)
    out = {"estimate": est}
    if a.budget_gb:
        out["longest_sequence"] = {
            ulysses: longest_sequence(a.budget_gb * 1e9, 2 * ulysses * a.cp, ulysses=ulysses, **kw)
            for ulysses in (1, 2, 4, 8, 16)
            if a.num_attention_heads // a.tp % ulysses == 0
        }
    if a.calibration and a.budget_gb:
        out["tokens_per_s_per_gpu"] = _speeds(a, out["longest_sequence"])
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    _print(a, est, out)
    return 0
