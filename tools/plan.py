#!/usr/bin/env python3
"""Predict per-rank memory and all-to-all bytes of a Ulysses GPT from its config and degrees.

    python tools/plan.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
        --num-query-groups 8 --ffn-hidden-size 14336 --vocab-size 128256 --seq-length 131072 \
        --tp 2 --ulysses 4 [--pp 2] [--bf16] [--budget-gb 80] [--recompute full] [--json]

Model of memory per rank (Megatron-Core local/TE layer, flash-style attention that keeps
no s x s matrix):

* weights, gradients (DDP buffer, fp32 when --bf16: grad_reduce_in_fp32), Adam state
  (fp32 m, v, and an fp32 master copy under --bf16), all divided by tp and pp;
* activations saved for backward, per layer, per local token (``s / (ulysses x cp)``):
  norm inputs and statistics, the QKV / proj / fc1 / fc2 inputs, q/k/v and the output of
  attention *in its head-sharded form* (all tokens, ``1/ulysses`` of the heads: the same
  bytes as ``1/ulysses`` of the tokens), the softmax log-sum-exp, the MLP activation input;
  plus the last stage's norm, logits input and cross-entropy softmax.  Full recompute keeps
  only each layer's input.
* all-to-all bytes sent per rank per layer: ``(P-1)/P`` of the local q, k, v (kv heads
  replicated where they are fewer than P) and of the output, forward and backward.

* the step's peak on top of the states: the larger of the backward's (activations, the fp32
  logits or, with ``--loss-chunk-tokens``, one chunk's, a vocabulary-sized weight gradient,
  the tiled MLP's chunk with ``--mlp-chunk-tokens``) and the optimizer step's temporaries --
  constants fitted to ``tools/bench_step_memory.py`` (within 3.7% of every measured peak,
  docs/memory.md).

``--budget-gb`` prints the longest sequence (multiple of 2 x degree) whose step peak fits, per degree.
"""

from __future__ import annotations

import argparse
import json
import sys


# fitted to tools/bench_step_memory.py (docs/perf/bench_step_memory.json); see docs/memory.md
K_LOGITS = 1.0  # fp32 logits-sized buffers alive at the step's peak
K_MLP_CHUNK = 2.0  # tiled MLP: one chunk's intermediates and their gradients during its backward
K_OPT_TORCH = 1.75  # fp32 parameter-sized temporaries of torch's foreach Adam (CPU, or no TE / Apex); fused: ~0
K_VOCAB_GRAD = 1.0  # a vocabulary-sized weight's gradient [V/tp, h], fp32, before it joins the DDP buffer


def estimate(
    *,
    num_layers,
    hidden_size,
    num_attention_heads,
    num_query_groups=None,
    ffn_hidden_size=None,
    vocab_size=50304,
    seq_length=4096,
    micro_batch_size=1,
    tp=1,
    ulysses=1,
    cp=1,
    pp=1,
    bf16=False,
    recompute=None,
    swiglu=False,
    distributed_optimizer=False,
    dp=1,
    loss_chunk_tokens=None,
    mlp_chunk_tokens=None,
    runtime_bytes=0,
    torch_adam=False,
):
    g = num_query_groups or num_attention_heads
    ffn = ffn_hidden_size or 4 * hidden_size
    d = hidden_size // num_attention_heads
    act = 2 if bf16 else 4  # bytes per activation element
    s_local = seq_length // (ulysses * cp)
    b = micro_batch_size
    L = num_layers // pp
    hq, hk = num_attention_heads // tp, g // tp  # heads per tensor-parallel rank
    qkv_width = (hq + 2 * hk) * d
    # ---- parameters (per tp/pp rank)
    per_layer = (
        hidden_size * (num_attention_heads + 2 * g) * d
        + (num_attention_heads + 2 * g) * d  # qkv
        + num_attention_heads * d * hidden_size
        + hidden_size  # proj
        + hidden_size * ffn * (2 if swiglu else 1)
        + ffn * (2 if swiglu else 1)  # fc1
        + ffn * hidden_size
        + hidden_size  # fc2
        + 4 * hidden_size
    )  # 2 norms
    params = L * per_layer / tp + (vocab_size * hidden_size * 2 / tp) / max(pp, 1) + 2 * hidden_size
    w_bytes = params * (2 if bf16 else 4)
    g_bytes = params * 4
    opt_bytes = params * (12 if bf16 else 8)
    if distributed_optimizer:
        opt_bytes /= dp * ulysses * cp
    # ---- activations per local token, elements
    h_tp = hidden_size  # norm / residual width (sequence parallel would divide by tp)
    fc1_out = ffn * (2 if swiglu else 1) / tp
    layer = (
        (h_tp + 2)  # input layernorm: input + mean/rstd
        + h_tp  # linear_qkv input
        + qkv_width  # q, k, v as the kernel saves them (head-sharded: 1/ulysses of heads, all tokens)
        + hq * d  # attention output
        + hq  # log-sum-exp
        + hq * d  # linear_proj input
        + (h_tp + 2)  # pre-MLP layernorm
        + h_tp  # linear_fc1 input
        + (0 if mlp_chunk_tokens else fc1_out + ffn / tp)  # activation + linear_fc2 inputs (tiled: recomputed)
    )
    if recompute == "full":  # layer inputs kept; one layer's activations live again during its backward
        layer_full, layer = layer, h_tp
    else:
        layer_full = 0.0
    head = (hidden_size + 2) + hidden_size  # final norm, output-layer input
    act_bytes = act * s_local * b * (L * layer + layer_full) + 4 * s_local * b * head
    # ---- what a step holds on top (measured by tools/bench_step_memory.py, fitted constants):
    # the logits [tokens, V/tp] in fp32 (Megatron's cross-entropy works in place on them and keeps
    # them as its softmax for backward; chunked: one chunk's, plus 8 bytes per token of
    # log-sum-exp and target), the tiled MLP's recomputed chunk, and the optimizer step's temporaries
    T = s_local * b
    logit_rows = min(T, loss_chunk_tokens) if loss_chunk_tokens else T
    loss_bytes = K_LOGITS * 4 * logit_rows * vocab_size / tp + (8 * T if loss_chunk_tokens else 0)
    mlp_bytes = K_MLP_CHUNK * act * min(T, mlp_chunk_tokens) * (fc1_out + ffn / tp) if mlp_chunk_tokens else 0.0
    # the peak is either in backward (activations, logits, the MLP chunk) or in the optimizer step
    # (activations freed by then, its temporaries instead)
    vocab_grad = K_VOCAB_GRAD * 4 * vocab_size / tp * hidden_size
    step_transient = max(
        act_bytes + loss_bytes + mlp_bytes + vocab_grad, K_OPT_TORCH * params * 4 if torch_adam else 0.0
    )
    # ---- all-to-all bytes per rank
    P = ulysses
    q_heads_rank, kv_rank = hq // max(P, 1), max(hk // max(P, 1), 1)
    qkv_local = s_local * b * P * (q_heads_rank + 2 * kv_rank) * d * act
    out_local = s_local * b * hq * d * act
    a2a_layer = 2 * (P - 1) / P * (qkv_local + out_local) if P > 1 else 0.0
    # ---- ring shifts per rank (hybrid, cp > 1): k/v of this rank's heads over its ring shard
    kv_blk = 2 * s_local * P * b * kv_rank * d * act
    ring_layer = (3 * cp - 2) * kv_blk if cp > 1 else 0.0  # fwd cp-1; bwd cp-1 k/v + cp dk/dv
    return {
        "params_per_rank": params,
        "weights_bytes": w_bytes,
        "grads_bytes": g_bytes,
        "optimizer_bytes": opt_bytes,
        "activations_bytes": act_bytes,
        "loss_transient_bytes": loss_bytes,
        "step_transient_bytes": step_transient,
        "step_peak_bytes": runtime_bytes + w_bytes + g_bytes + opt_bytes + step_transient,
        "total_bytes": runtime_bytes + w_bytes + g_bytes + opt_bytes + step_transient,
        "tokens_per_rank": s_local,
        "a2a_bytes_per_layer": a2a_layer,
        "a2a_bytes_per_step": a2a_layer * L,
        "ring_bytes_per_layer": ring_layer,
    }


def longest_sequence(budget_bytes, step, **kw):
    """Largest multiple of ``step`` whose estimated total fits ``budget_bytes`` (binary search)."""
    lo, hi = 0, step
    while estimate(seq_length=hi, **kw)["total_bytes"] <= budget_bytes and hi < 2**34:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if estimate(seq_length=mid, **kw)["total_bytes"] <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    kw = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups,
        ffn_hidden_size=a.ffn_hidden_size,
        vocab_size=a.vocab_size,
        micro_batch_size=a.micro_batch_size,
        tp=a.tp,
        cp=a.cp,
        pp=a.pp,
        bf16=a.bf16,
        recompute=a.recompute,
        swiglu=a.swiglu,
        distributed_optimizer=a.use_distributed_optimizer,
        dp=a.dp,
        loss_chunk_tokens=a.loss_chunk_tokens,
        mlp_chunk_tokens=a.mlp_chunk_tokens,
        torch_adam=a.torch_adam,
    )
    est = estimate(seq_length=a.seq_length, ulysses=a.ulysses, **kw)
    out = {"estimate": est}
    if a.budget_gb:
        out["longest_sequence"] = {
            u: longest_sequence(a.budget_gb * 1e9, 2 * u * a.cp, ulysses=u, **kw)
            for u in (1, 2, 4, 8, 16)
            if a.num_attention_heads // a.tp % u == 0
        }
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
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
        for u, s in out["longest_sequence"].items():
            print(f"  ulysses {u:2d}: {s:>10d} tokens" + ("" if s else "  (does not fit)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
