"""Working memory at long context: chunked linear cross-entropy and a sequence-tiled MLP.

Ulysses divides activations by P, but two transients of every step do not shrink with it:

* the **logits** ``[tokens, V/tp]`` (fp32 in the loss, plus their gradient): Megatron's output
  layer and vocab-parallel cross-entropy materialise them whole.
  :func:`enable_chunked_loss` makes a built ``GPTModel`` compute the output projection and the
  cross-entropy ``chunk_tokens`` tokens at a time (:class:`ChunkedLinearCrossEntropy`), so at
  most one chunk's logits exist, in forward and in backward;
* the **MLP intermediate** ``[tokens, ffn/tp]`` (gate and up for SwiGLU) of every layer:
  :func:`tiled_mlp_class` is Megatron's ``MLP`` run over token chunks, each chunk's
  intermediates recomputed in backward (one ``autograd.Function``), chosen through the layer
  spec (:func:`ulysses_mcore.megatron.layer.specs.swap_mlp`).

Both are exact: the same per-token losses and gradients as the unchunked model up to
floating-point summation order (tests/test_memory.py: 1e-5 relative in fp32).

Design choice (measured, not assumed): the loss recomputes each chunk's logits in backward
instead of computing the gradients during the forward as Liger's fused kernel does.  The
forward-time gradients are exact only if the gradient that reaches the per-token losses is
known in the forward (Liger assumes a mean); Megatron's schedules scale the per-token losses by
the loss mask, the number of micro-batches and the loss scale afterwards.  The recompute costs
one extra ``[C, h] x [h, V/tp]`` matmul per chunk (the output layer's flops x 4/3) and holds
one chunk's logits at a time.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.mlp import MLP


# ------------------------------------------------------------------------ loss
def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token ``logsumexp(h W^T) - (h W^T)[label]`` over ``chunk`` tokens at a time.

    ``hidden [T, h]`` (every token of this rank, already gathered over tensor-parallel
    sequence shards), ``weight [V/tp, h]`` (this rank's vocabulary rows, starting at
    ``vocab_start``), ``labels [T]``.  Vocabulary-parallel: the max, the sum of exponentials and
    the target logit are reduced over ``tp_group``.  The gradient of ``hidden`` is this rank's
    partial sum over its vocabulary rows (the caller's tensor-parallel mapping reduces it, as
    Megatron's ``ColumnParallelLinear`` does).  The GEMMs run in the input dtype (bf16 in a bf16
    run); the softmax, its reductions and the sum of the weight's gradient over chunks in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, vocab):
        """``vocab = (tp_group, vocab_start)``: the vocabulary's tensor-parallel group, this rank's first id."""
        tp_group, vocab_start = vocab
        T, V = hidden.shape[0], weight.shape[0]
        lse = torch.empty(T, dtype=torch.float32, device=hidden.device)
        target = torch.empty(T, dtype=torch.float32, device=hidden.device)
        for c in range(0, T, chunk):
            logits = torch.matmul(hidden[c : c + chunk], weight.t()).float()  # [C, V/tp]: the only big buffer
            m = logits.max(dim=-1).values
            _all_reduce(m, dist.ReduceOp.MAX, tp_group)
            local = labels[c : c + chunk] - vocab_start
            inside = (local >= 0) & (local < V)
            tgt = logits.gather(1, local.clamp(0, V - 1).unsqueeze(1)).squeeze(1) * inside
            logits.sub_(m.unsqueeze(1)).exp_()
            sums = torch.stack([logits.sum(dim=-1), tgt])
            _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
            lse[c : c + chunk] = m + sums[0].log()
            target[c : c + chunk] = sums[1]
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        return lse - target

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk, V = ctx.chunk, weight.shape[0]
        grad_hidden = torch.empty_like(hidden)
        # the weight's gradient: summed over chunks in fp32 (one chunk alone: its GEMM's own output)
        grad_weight = None
        grad = grad.float()
        for c in range(0, hidden.shape[0], chunk):
            h = hidden[c : c + chunk]
            p = torch.matmul(h, weight.t()).float()  # GEMM in the input dtype; softmax in fp32
            p.sub_(lse[c : c + chunk].unsqueeze(1)).exp_()  # softmax over the whole vocabulary
            local = labels[c : c + chunk] - ctx.vocab_start
            inside = (local >= 0) & (local < V)
            p.scatter_add_(1, local.clamp(0, V - 1).unsqueeze(1), -inside.float().unsqueeze(1))
            p.mul_(grad[c : c + chunk].unsqueeze(1))
            p = p.to(weight.dtype)  # the two gradient GEMMs in the input dtype (fp32 accumulation inside)
            grad_hidden[c : c + chunk] = torch.matmul(p, weight)
            part = torch.matmul(p.t(), h)
            if grad_weight is None:
                grad_weight = part if c + chunk >= hidden.shape[0] else part.float()
            else:
                grad_weight += part
            del p, part
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def chunked_cross_entropy(
    hidden, weight, labels, chunk_tokens: int, *, tp_group=None, vocab_start: int = 0, sequence_parallel: bool = False
):
    """Per-token losses ``[b, s]`` from ``hidden [s(/tp), b, h]`` and ``labels [b, s]``, the
    output projection and cross-entropy computed ``chunk_tokens`` tokens at a time."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        if sequence_parallel:  # all-gather the sequence shards; backward: reduce-scatter the partial grads
            hidden = mappings.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=tp_group
            )
        else:  # backward: all-reduce the partial grads over the vocabulary shards
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    s, b, h = hidden.shape
    flat_labels = labels.transpose(0, 1).reshape(-1)  # [s*b], the order of hidden's rows
    loss = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(s * b, h), weight, flat_labels, max(1, int(chunk_tokens)), (tp_group, vocab_start)
    )
    return loss.view(s, b).transpose(0, 1).contiguous()


def enable_chunked_loss(model, chunk_tokens: int):
    """Make a built Megatron-Core ``GPTModel`` (the last pipeline stage; a DDP wrapper is
    looked through) compute its loss with :func:`chunked_cross_entropy`: the one hook.

    When ``forward`` is called with ``labels``, the output layer hands its input through
    (no logits) together with its weight (the shared embedding weight when tied) and
    ``compute_language_model_loss`` receives the hidden states and computes the chunked loss;
    without ``labels`` (evaluation of logits, inference) the model is unchanged.  Parameter
    names and checkpoints are unchanged.  Returns the model."""
    core = model.module if hasattr(model, "module") and not hasattr(model, "output_layer") else model
    if getattr(core, "output_layer", None) is None or not getattr(core, "post_process", True):
        return model  # not the last stage: no output layer here
    if chunk_tokens < 1:
        raise ValueError(f"--loss-chunk-tokens must be >= 1, got {chunk_tokens}")
    cfg = core.config
    if getattr(cfg, "mtp_num_layers", None):
        raise ValueError("--loss-chunk-tokens does not support multi-token prediction (--mtp-num-layers)")
    if getattr(cfg, "use_mup", False) or getattr(cfg, "mup_output_mult", None) not in (None, 1, 1.0):
        raise ValueError("--loss-chunk-tokens does not support MuP logit scaling")
    out = core.output_layer
    state = {"defer": False, "weight": None}
    plain_forward = out.forward

    def output_forward(hidden_states, weight=None, runtime_gather_output=None, **kw):
        if not state["defer"]:
            return plain_forward(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output, **kw)
        state["weight"] = weight if weight is not None else out.weight
        return hidden_states, None  # the "logits" that compute_language_model_loss receives

    def loss_fn(self, labels, hidden_states):

        weight, state["weight"] = state["weight"], None
        tp_group = getattr(out, "tp_group", None) or ps.get_tensor_model_parallel_group()
        tp_rank = dist.get_rank(tp_group) if dist.get_world_size(tp_group) > 1 else 0
        return chunked_cross_entropy(
            hidden_states,
            weight,
            labels,
            chunk_tokens,
            tp_group=tp_group,
            vocab_start=tp_rank * weight.shape[0],
            sequence_parallel=bool(getattr(out, "sequence_parallel", False)),
        )

    def pre_hook(module, args, kwargs):
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)  # forward(ids, pos, mask, dec_in, labels)
        state["defer"] = labels is not None

    out.forward = output_forward
    core.compute_language_model_loss = types.MethodType(loss_fn, core)
    core.register_forward_pre_hook(pre_hook, with_kwargs=True)
    core.loss_chunk_tokens = int(chunk_tokens)
    return model


# ------------------------------------------------------------------------ MLP
def _by_chunks(run, rows: int, x):
    """``run`` over ``rows``-row chunks of ``x``, each output written into one result."""
    out = None
    for c in range(0, x.shape[0], rows):
        o = run(x[c : c + rows])
        if out is None:
            out = o.new_empty((x.shape[0], *o.shape[1:]))
        out[c : c + rows] = o
        del o
    return out


class _Tiles(torch.autograd.Function):
    """``run`` (the MLP without its output bias) over ``rows``-row chunks of ``x``: each chunk's
    output written into one ``[s, b, h]`` result, nothing of a chunk kept; the backward recomputes
    each chunk with gradients and writes its input gradient into one ``[s, b, h]`` buffer, the
    weights' gradients summed over the chunks (fp32 when the weights are lower precision).
    Slicing ``x`` under autograd instead (``torch.utils.checkpoint`` per chunk) made every chunk's
    input gradient a whole-sequence tensor (``slice_backward``), summed one by one: two ``[s, b, h]``
    buffers live at the backward's peak and a whole-sequence add per chunk."""

    @staticmethod
    def forward(ctx, run, rows: int, x, *weights):
        ctx.run, ctx.rows = run, rows
        ctx.save_for_backward(x, *weights)
        return _by_chunks(run, rows, x)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        sums = [None] * len(weights)
        for c in range(0, x.shape[0], ctx.rows):
            part = x[c : c + ctx.rows].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                o = ctx.run(part)
            wanted = ([part] if grad_x is not None else []) + weights
            got = list(torch.autograd.grad(o, wanted, grad[c : c + ctx.rows], allow_unused=True))
            if grad_x is not None:
                grad_x[c : c + ctx.rows] = got.pop(0)
            for i, g in enumerate(got):
                if g is not None:
                    sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
            del o, got
        return (None, None, grad_x, *(s if s is None else s.to(w.dtype) for s, w in zip(sums, weights)))


class _TiledMLPMixin:
    """Megatron's MLP over ``chunk_tokens``-token chunks of the sequence, each chunk's
    intermediates recomputed in backward (:class:`_Tiles`): the ``[tokens, ffn/tp]`` intermediate
    exists one chunk at a time.  Token-wise, so exact; with sequence parallelism each chunk is
    gathered and reduce-scattered by the linear layers as a whole sequence would be."""

    chunk_tokens = 0

    def forward(self, hidden_states, *args, **kwargs):

        parent = super().forward
        s, b = hidden_states.shape[0], hidden_states.shape[1]
        rows = max(1, self.chunk_tokens // max(1, b))
        if s <= rows:
            return parent(hidden_states, *args, **kwargs)
        bias = []

        def run(x):  # the output; the output bias (a parameter, the same for every chunk) handed back as is
            out, b_ = parent(x, *args, **kwargs)
            bias[:] = [b_]
            return out

        if not torch.is_grad_enabled():  # full recompute's first forward, evaluation: nothing to keep
            return _by_chunks(run, rows, hidden_states), bias[0]
        weights = [p for p in self.parameters() if p.requires_grad]
        return _Tiles.apply(run, rows, hidden_states, *weights), bias[0]


class _KindOfMLP(type):
    """The tiled classes compare equal to the MLP class they tile: megatron-core 0.16's
    ``TransformerLayer`` hands the tensor-parallel group to an mlp module only when
    ``module == MLP`` (any other class is logged as an unknown MLP type and built without it)."""

    def __eq__(cls, other):
        return cls is other or other is cls.__dict__.get("_tiles")

    __hash__ = type.__hash__


@functools.cache
def tiled_mlp_class(chunk_tokens: int, base=None):
    """A subclass of Megatron's ``MLP`` (or ``base``) that tiles ``chunk_tokens`` tokens at a time."""
    if base is None:
        base = MLP
    if chunk_tokens < 1:
        raise ValueError(f"--mlp-chunk-tokens must be >= 1, got {chunk_tokens}")
    return _KindOfMLP(
        f"TiledMLP{chunk_tokens}",
        (_TiledMLPMixin, base),
        {"chunk_tokens": int(chunk_tokens), "_tiles": base, "__module__": __name__},
    )


__all__ = ["ChunkedLinearCrossEntropy", "chunked_cross_entropy", "enable_chunked_loss", "tiled_mlp_class"]
