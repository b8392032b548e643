"""Predict per-rank memory and all-to-all bytes of a Ulysses GPT from its config and degrees.

    ulysses-mcore plan --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
        --num-query-groups 8 --ffn-hidden-size 14336 --vocab-size 128256 --seq-length 131072 \
        --tp 2 --ulysses 4 [--pp 2] [--bf16] [--budget-gb 80] [--recompute full] [--json]

Model of memory per rank (Megatron-Core local/TE layer, flash-style attention that keeps
no s x s matrix):

* weights, gradients (DDP buffer, fp32 when --bf16 unless --grad-reduce-in-bf16), Adam state
  (fp32 m, v, and an fp32 master copy under --bf16), all divided by tp and pp;
* activations saved for backward, per layer, per local token (``s / (ulysses x cp)``):
  norm inputs and statistics, the QKV / proj / fc1 / fc2 inputs, q/k/v and the output of
  attention *in its head-sharded form* (all tokens, ``1/ulysses`` of the heads: the same
  bytes as ``1/ulysses`` of the tokens), the softmax log-sum-exp, the MLP activation input;
  plus the last stage's norm, logits input and cross-entropy softmax.  Full recompute keeps
  only each layer's input (and one layer's activations, all-to-all buffers -- at ulysses 1 the
  kernel's layout copies -- and ring blocks during its recompute); with
  ``--offload-activation-checkpoints`` those inputs live in host
  memory (``host_bytes``) and one of them on the device at the recomputed layer's peak (the one in
  use; the layer below's comes back after the attention's backward);
  with ``--optimizer-cpu-offload`` Adam's state and master weights are host memory too.
* all-to-all bytes sent per rank per layer: ``(P-1)/P`` of the local q, k, v (kv heads
  replicated where they are fewer than P) and of the output, forward and backward.

* the step's peak on top of the states: the larger of the backward's (activations, the fp32
  logits -- with --bf16 beside the output layer's bf16 logits -- or, with ``--loss-chunk-tokens``,
  one chunk's, a vocabulary-sized weight gradient, the tiled MLP's chunk with
  ``--mlp-chunk-tokens``) and the optimizer step's temporaries -- constants fitted to
  ``tools/bench_step_memory.py`` (within 3.7% of every measured peak, docs/memory.md), the bf16
  and SwiGLU terms from the dry run (docs/dryrun.md).

``--budget-gb`` prints the longest sequence (multiple of 2 x degree) whose step peak fits, per degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


# fitted to tools/bench_step_memory.py (docs/perf/bench_step_memory.json); see docs/memory.md
K_LOGITS = 1.0  # fp32 logits-sized buffers alive at the step's peak
K_MLP_CHUNK = 2.0  # tiled MLP: one chunk's intermediates and their gradients during its backward
K_OPT_TORCH = 1.75  # fp32 parameter-sized temporaries of torch's foreach Adam (CPU, or no TE / Apex); fused: ~0
K_VOCAB_GRAD = 1.0  # a vocabulary-sized weight's gradient [V/tp, h], fp32, before it joins the DDP buffer


@dataclass(frozen=True)
class _Shape:
    """One estimate's inputs, with the derived sizes every step below uses."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 50304
    seq_length: int = 4096
    micro_batch_size: int = 1
    tp: int = 1
    ulysses: int = 1
    cp: int = 1
    pp: int = 1
    bf16: bool = False
    recompute: Optional[str] = None
    swiglu: bool = False
    distributed_optimizer: bool = False
    dp: int = 1
    loss_chunk_tokens: Optional[int] = None
    mlp_chunk_tokens: Optional[int] = None
    runtime_bytes: float = 0
    torch_adam: bool = False
    offload: bool = False  # --offload-activation-checkpoints: the layer inputs in host memory
    optimizer_offload: bool = False  # --optimizer-cpu-offload: Adam's state and master weights in host memory
    kv_channels: Optional[int] = None  # channels per head (None: hidden / heads)
    tied_embeddings: bool = False  # the output layer shares the input embedding (Megatron-LM's default)
    grad_reduce_in_bf16: bool = False  # --grad-reduce-in-bf16 (with --bf16): DDP's gradient buffer in bf16
    bias_linear: bool = True  # the linear layers' biases (Megatron's default; --disable-bias-linear: none)
    qk_layernorm: bool = False  # per-head query and key norms (--qk-layernorm): they save views of the QKV output

    @property
    def g(self):
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn(self):
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def d(self):
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def act(self):
        return 2 if self.bf16 else 4  # bytes per activation element

    @property
    def s_local(self):
        return self.seq_length // (self.ulysses * self.cp)

    @property
    def layers(self):
        return self.num_layers // self.pp

    @property
    def heads(self):
        return self.num_attention_heads // self.tp, self.g // self.tp  # per tensor-parallel rank

    @property
    def fc1_out(self):
        return self.ffn * (2 if self.swiglu else 1) / self.tp

    @property
    def glu_kept(self):
        """SwiGLU keeps silu(gate) for the product's backward, beside fc1's output and fc2's input
        (Megatron's unfused GLU; measured by the dry run: docs/dryrun.md)."""
        return self.ffn / self.tp if self.swiglu else 0.0


def _params(c: _Shape) -> float:
    """Parameters per tp / pp rank."""
    h, nh, g, d, ffn, glu = c.hidden_size, c.num_attention_heads, c.g, c.d, c.ffn, 2 if c.swiglu else 1
    per_layer = (
        h * (nh + 2 * g) * d + (nh + 2 * g) * d  # qkv
        + nh * d * h + h  # proj
        + h * ffn * glu + ffn * glu  # fc1
        + ffn * h + h  # fc2
        + 4 * h  # 2 norms
    )  # fmt: skip
    copies = 1 if c.tied_embeddings else 2  # input embedding and output layer
    return c.layers * per_layer / c.tp + (c.vocab_size * h * copies / c.tp) / max(c.pp, 1) + 2 * h


def _states(c: _Shape, params: float):
    """(weights, gradients, optimizer) bytes: grads fp32 (DDP buffer; bf16 with --grad-reduce-in-bf16),
    Adam m, v (+ fp32 master under bf16)."""
    opt = params * (12 if c.bf16 else 8) / _optimizer_shards(c)
    return params * (2 if c.bf16 else 4), params * (2 if c.bf16 and c.grad_reduce_in_bf16 else 4), opt


def _optimizer_shards(c: _Shape) -> int:
    """The ranks Adam's state is split over: dp x ulysses x cp with the distributed optimizer."""
    return c.dp * c.ulysses * c.cp if c.distributed_optimizer else 1


def _offloaded(c: _Shape, params: float, opt: float):
    """(host, device) bytes of the optimizer: with --optimizer-cpu-offload Megatron's hybrid-device
    optimizer keeps an fp32 copy of the rank's weights, their fp32 gradients and Adam's two moments
    on the host (16 bytes a parameter of its shard, as the dry run measures), none on the device."""
    if not c.optimizer_offload:
        return 0.0, opt
    return 16 * params / _optimizer_shards(c), 0.0


def _activations(c: _Shape) -> float:
    """Bytes saved for backward: per layer per local token, plus the last stage's head."""
    h_tp, (hq, hk), d = c.hidden_size, c.heads, c.d  # norm / residual width (sequence parallel would divide by tp)
    layer = (
        (h_tp + 2)  # input layernorm: input + mean/rstd
        + h_tp  # linear_qkv input
        + (hq + 2 * hk) * d  # q, k, v as the kernel saves them (head-sharded: 1/ulysses of heads, all tokens)
        + hq * d  # attention output
        + hq  # log-sum-exp
        + hq * d  # linear_proj input
        + (h_tp + 2)  # pre-MLP layernorm
        + h_tp  # linear_fc1 input
        + (0 if c.mlp_chunk_tokens else c.fc1_out + c.glu_kept + c.ffn / c.tp)  # activation + linear_fc2 inputs
    )  # (tiled MLP: recomputed)
    layer_full, kept = 0.0, c.layers
    if c.recompute == "full":  # layer inputs kept; one layer's activations live again during its backward
        # its all-to-alls' send and receive buffers of q, k, v and the output; at ulysses 1 the kernel's
        # own layout copies of them, once (the dry run: 10,240 elements a token for Llama-3-8B on one GPU)
        exchange = 2 * ((hq + 2 * hk) * d + hq * d)
        if c.ulysses == 1:  # fitted at tp 1, where it stands for residual-stream-wide tensors (gradients, norm
            # outputs) that tp does not divide without sequence parallelism: the dry run of Qwen3-4B at tp 4
            # (10.3 [s, h] at the recomputed layer's peak, 8 of them [s, h] wide) -- so its tp-1 width
            exchange = c.tp * exchange / 2
        ring = 6 * hk * d + 2 * (hq * d + hq) if c.cp > 1 else 0  # k/v blocks in flight, fp32 output and lse
        # at ulysses 1 (no all-to-all buffers) the recomputed layer's peak is in its MLP phase, which the
        # tiled MLP made one [s, h] smaller (its backward held the per-chunk whole-sequence gradients of
        # torch.utils.checkpoint, which this term was fitted to; the dry run measures one less since)
        tiled = h_tp if c.mlp_chunk_tokens and c.ulysses * c.cp == 1 else 0
        # there, at the tiled MLP's bias-dropout-add, its output plus its bias is one more [s, h] (the dry run)
        unbiased = tiled if not c.bias_linear else 0
        # the packed QKV projection's share of the recomputed layer, against what the terms above count:
        # at ulysses 1 the kernel keeps its own copy of v, not the projection v is a slice of (less); at
        # ulysses > 1 the all-to-all's copies free it, but --qk-layernorm's norms save views of it, so it
        # stays (more: the dry run of Qwen3-4B at tp 2 x ulysses 2; at ulysses 1 with them, no change)
        if c.qk_layernorm:
            projection = (hq + 2 * hk) * d if c.ulysses > 1 else 0
        else:
            projection = -(hq + hk) * d if c.ulysses == 1 else 0
        # offloaded: Megatron's recompute holds its output's shape, not its bytes (offload.ShapeOnly)
        released = h_tp if c.offload else 0
        layer_full, layer = layer + exchange + ring - tiled - unbiased + projection - released, h_tp
        # offloaded: the input in use; the layer below's comes back after the attention's backward
        kept = min(c.layers, 1) if c.offload else c.layers
    head = (c.hidden_size + 2) + c.hidden_size  # final norm, output-layer input (in the activations' dtype)
    tokens = c.s_local * c.micro_batch_size
    return c.act * tokens * (kept * layer + layer_full + head)


def _host(c: _Shape) -> float:
    """Bytes of host memory a rank holds at the end of the forward with --offload-activation-checkpoints
    (the dry run's count): every layer's input, the final norm's and the output layer's, and without
    a chunked loss its fp32 logits (the ones still on the device are copies)."""
    if not c.offload:
        return 0.0
    tokens = c.s_local * c.micro_batch_size
    logits = 0.0 if c.loss_chunk_tokens else 4 * tokens * c.vocab_size / c.tp
    return c.act * tokens * c.hidden_size * (c.layers + 2) + logits


def _transients(c: _Shape, params: float, act_bytes: float):
    """(loss bytes, the step's transient peak): what a step holds on top of the states (measured by
    tools/bench_step_memory.py, fitted constants) -- the logits [tokens, V/tp] in fp32 (chunked: one
    chunk's, plus 8 bytes per token of log-sum-exp and target), the tiled MLP's recomputed chunk, a
    vocabulary-sized weight gradient; or the optimizer step's temporaries, whichever is larger."""
    T = c.s_local * c.micro_batch_size
    rows = min(T, c.loss_chunk_tokens) if c.loss_chunk_tokens else T
    loss = K_LOGITS * 4 * rows * c.vocab_size / c.tp + (8 * T if c.loss_chunk_tokens else 0)
    if c.bf16:  # the output layer's bf16 logits stay alive beside their fp32 copy in the loss (dry run)
        loss += 2 * rows * c.vocab_size / c.tp
    mlp = K_MLP_CHUNK * c.act * min(T, c.mlp_chunk_tokens) * (c.fc1_out + c.ffn / c.tp) if c.mlp_chunk_tokens else 0.0
    vocab_grad = K_VOCAB_GRAD * 4 * c.vocab_size / c.tp * c.hidden_size
    return loss, max(act_bytes + loss + mlp + vocab_grad, K_OPT_TORCH * params * 4 if c.torch_adam else 0.0)


def _messages(c: _Shape):
    """(all-to-all bytes per rank per layer, ring-shift bytes per rank per layer)."""
    ulysses, (hq, hk), d, b = c.ulysses, c.heads, c.d, c.micro_batch_size
    q_heads_rank, kv_rank = hq // max(ulysses, 1), max(hk // max(ulysses, 1), 1)
    qkv_local = c.s_local * b * ulysses * (q_heads_rank + 2 * kv_rank) * d * c.act
    out_local = c.s_local * b * hq * d * c.act
    a2a = 2 * (ulysses - 1) / ulysses * (qkv_local + out_local) if ulysses > 1 else 0.0
    kv_blk = 2 * c.s_local * ulysses * b * kv_rank * d * c.act  # hybrid: k/v of this rank's heads over its ring shard
    return a2a, (3 * c.cp - 2) * kv_blk if c.cp > 1 else 0.0  # fwd cp-1; bwd cp-1 k/v + cp dk/dv


def estimate(**kw) -> dict:
    """Per-rank memory and message bytes of a GPT layout (keywords: the fields of :class:`_Shape`:
    ``num_layers, hidden_size, num_attention_heads`` required)."""
    c = _Shape(**kw)
    params = _params(c)
    w_bytes, g_bytes, opt_bytes = _states(c, params)
    host_opt, opt_bytes = _offloaded(c, params, opt_bytes)
    act_bytes = _activations(c)
    loss_bytes, step_transient = _transients(c, params, act_bytes)
    a2a_layer, ring_layer = _messages(c)
    total = c.runtime_bytes + w_bytes + g_bytes + opt_bytes + step_transient
    return {
        "params_per_rank": params,
        "weights_bytes": w_bytes,
        "grads_bytes": g_bytes,
        "optimizer_bytes": opt_bytes,
        "activations_bytes": act_bytes,
        "loss_transient_bytes": loss_bytes,
        "step_transient_bytes": step_transient,
        "step_peak_bytes": total,
        "total_bytes": total,
        "tokens_per_rank": c.s_local,
        "a2a_bytes_per_layer": a2a_layer,
        "a2a_bytes_per_step": a2a_layer * c.layers,
        "ring_bytes_per_layer": ring_layer,
        "host_bytes": _host(c) + host_opt,
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
