"""Ring attention over the ring context-parallel group, merging partial results by log-sum-exp.

Used by the hybrid Ulysses x ring path: after the Ulysses all-to-all a rank holds, for its
band of heads, the tokens of its *ring* shard; the ring then passes key/value blocks around
the ``cp`` group so every query meets every key.  On GPU the same job is Transformer
Engine's p2p context parallelism (``backend="te"``); this module is the portable version
(CPU/gloo, or any backend), written with plain matmuls so it is exact and testable here.

Blocks without a mask, bias or document boundary run through torch's fused flash kernel of
their device, in the input dtype (:func:`fused_kernel`: the CPU one in fp32 / bf16, the CUDA one
in fp16 / bf16), which returns the log-sum-exp the merge needs; its backward is fed the final
output and log-sum-exp.  Only the merge accumulates in fp32.  The rest (masks, bias, documents,
windows, fp64, value heads of another size) runs the matmul form below in fp32, one tile of at
most ``LSE_TILE`` x ``LSE_TILE`` tokens at a time.

Token order: ring rank ``j`` of ``C`` holds chunks ``j`` and ``2C-1-j`` of ``2C`` equal
chunks (``"load_balanced"``, Megatron's dual-chunk order: every rank gets the same causal
work) or chunk ``j`` of ``C`` (``"contiguous"``).  A rank's tokens are a few *segments* of
global positions; each (query segment, key segment) pair is skipped when causality hides
it entirely, computed without a mask when it lies wholly below the diagonal, and with the
causal triangle otherwise.  Masks and additive bias cover the full sequence, indexed by
global positions.

Single-rank reference (what the ring computes, per query row ``i``)::

    out_i = sum_blocks exp(lse_blk_i - lse_i) * out_blk_i,   lse_i = logsumexp_blocks lse_blk_i

Forward: ``C`` steps; at step ``t`` rank ``j`` holds the k/v block of rank ``(j - t) % C``
and, while it computes with it, passes it on to ``j + 1`` (an asynchronous ring shift,
``C - 1`` in all).  Backward: the same ring with ``dk``/``dv`` partial sums travelling behind
their block (each rank adds its part and passes it on while computing the next block), plus
one last shift that brings each block's gradient home.

The shift is an ``all_to_all_single`` with split sizes (send to the next rank, receive from
the previous one): one primitive that gloo, NCCL and the threaded test backend all have.

The same engine (:class:`LseAttention`, ``group=None``) is the ``sdpa`` backend's kernel for what
SDPA cannot express: a sliding window ``(left, right)`` (segments cut into tiles, tiles outside
the window never computed, so memory is ``O(s x tile)`` instead of ``O(s^2)``), attention sinks
(one extra key per head whose score is the sink logit and whose value is 0: the final
``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``; the backward is unchanged
given the final out and lse, plus ``d sink = -sum_i exp(sink - lse'_i) D_i``), value heads of
another size than query/key heads (MLA), and the log-sum-exp as a differentiable output
(``d lse_i / d s_ij = p_ij``: the row term ``D_i`` becomes ``D_i - dlse_i``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .heads import seq_dim
from .transport import all_to_all
from .blocks import (
    Scoring,
    Segments,
    attention_window,
    backward_tile,
    block_grads,
    blocks_of,
    call_is_fused,
    fused_forward,
    fused_kernel,
    safe_exp_diff,
    sink_grad,
    tile_segments,
)
from .options import LSE_TILE
from .orders import document_ids, host_bounds


def ring_segments(rank: int, size: int, seq_len: int, token_order: str) -> Segments:
    """Global positions held by ring rank ``rank``: one or two ``(start, length)`` segments."""
    if token_order == "load_balanced":
        n = seq_len // (2 * size)
        return [(rank * n, n), ((2 * size - 1 - rank) * n, n)]
    n = seq_len // size
    return [(rank * n, n)]


def _shift(buf: torch.Tensor, group, async_op: bool = True):
    """Send ``buf`` to the next ring rank, receive the previous rank's; returns (recv, work)."""
    C, me = dist.get_world_size(group), dist.get_rank(group)
    flat = buf.reshape(-1)
    n = flat.numel()
    recv = torch.empty_like(flat)
    nxt, prv = (me + 1) % C, (me - 1) % C
    in_splits = [n if r == nxt else 0 for r in range(C)]
    out_splits = [n if r == prv else 0 for r in range(C)]
    work = all_to_all(recv, flat, group, out_splits, in_splits, async_op=async_op)
    return recv.view(buf.shape), work


def _wait(work):
    if work is not None:
        work.wait()


class RingWalk(NamedTuple):
    """One call's walk over the ring, fixed for the call: the ring's ``group`` (None: no ring), what
    every block's scores need (:class:`~ulysses_mcore.blocks.Scoring`), the whole sequence's length,
    the token order of the shards and the tile (None: segments whole)."""

    group: Any
    scoring: Scoring
    seq_len: int
    token_order: str
    tile: Optional[int]


def _ring_size(group) -> Tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


class LseAttention(torch.autograd.Function):
    """``q [b, hk, g, Sq, d]``, ``k [b, hk, 1, Sk, d]``, ``v [b, hk, 1, Sk, dv]`` of this ring rank
    -> ``(out [b, hk, g, Sq, dv], lse [b, hk, g, Sq])``, both differentiable.

    ``group=None``: no ring, the whole sequence is here (the tiled single-rank kernel).  ``sink``
    (``[hk*g]`` logits or None): one extra key per head with score ``sink`` and value 0 -- the
    softmax's denominator gains ``exp(sink)`` (off-by-one: 0; learnable: a parameter).  ``tile``:
    query and key segments cut into tiles of that many tokens, so the scores held at once are
    ``[b, h, tile, tile]`` and tiles outside the window are never computed (``walk``: :class:`RingWalk`)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, walk: RingWalk):
        group, scoring, seq_len, token_order, tile = walk
        C, me = _ring_size(group)
        acc = torch.promote_types(q.dtype, torch.float32)  # the merge's dtype (and the matmul engine's)
        d, same = k.shape[-1], k.shape[-1] == v.shape[-1]
        my_segs = tile_segments(ring_segments(me, C, seq_len, token_order), tile)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1) if C > 1 else None
        for step in range(C):
            src = (me - step) % C
            recv, work = _shift(kv, group) if step < C - 1 else (None, None)
            ka, va = (k, v) if kv is None else (kv[..., :d], kv[..., d:])
            k_segs = tile_segments(ring_segments(src, C, seq_len, token_order), tile)
            for blk, rq, rk in blocks_of(my_segs, k_segs, scoring):
                if blk.fused(q, same):  # the input dtype through the fused kernel; its lse is fp32
                    b_out, b_lse = fused_forward(q[..., rq, :], ka[..., rk, :], va[..., rk, :], blk)
                    b_out, b_lse = b_out.to(acc), b_lse.to(acc)
                else:  # one tile in the accumulation dtype
                    s = blk.scores(q[..., rq, :].to(acc), ka[..., rk, :].to(acc))
                    b_lse = torch.logsumexp(s, dim=-1)
                    p = safe_exp_diff(s, b_lse[..., None])
                    b_out = torch.matmul(p, va[..., rk, :].to(acc))
                new = torch.logaddexp(lse[..., rq], b_lse)
                out[..., rq, :] = (
                    out[..., rq, :] * safe_exp_diff(lse[..., rq], new)[..., None]
                    + b_out * safe_exp_diff(b_lse, new)[..., None]
                )
                lse[..., rq] = new
            _wait(work)
            if recv is not None:
                kv = recv
        if sink is not None:  # the sink: one more key of score `sink` and value 0 per head
            s5 = sink.detach().to(acc).view(1, *q.shape[1:3], 1)
            new = torch.logaddexp(lse, s5)
            out *= safe_exp_diff(lse, new)[..., None]
            lse = new
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.walk = walk
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse.detach().clone()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        group, scoring, seq_len, order, tile = ctx.walk
        C, me = _ring_size(group)
        acc = out.dtype
        d, same = k.shape[-1], k.shape[-1] == v.shape[-1]
        do = torch.zeros_like(out) if dout is None else dout.to(acc)
        # 1. D_i = sum_d dO_i O_i - dlse_i: the softmax backward's row term (d lse_i / d s_ij = p_ij)
        D = (do * out).sum(-1)
        if dlse is not None:
            D = D - dlse.to(acc)
        fused_ok = dlse is None  # the fused backward computes D itself, without the lse term
        low = (do.to(q.dtype), out.to(q.dtype)) if fused_ok and fused_kernel(q, same) else None
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        incoming = None  # (buffer, work): the partial dk/dv of the block computed next, in flight
        tile = backward_tile(tile, fused_ok and same)
        my_segs = tile_segments(ring_segments(me, C, seq_len, order), tile)
        for step in range(C):
            src = (me - step) % C
            recv_kv, work_kv = _shift(kv, group) if step < C - 1 else (None, None)
            ka, va = kv[..., :d], kv[..., d:]
            dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)  # this rank's part for block src
            dk, dv = dkv[..., :d], dkv[..., d:]
            k_segs = tile_segments(ring_segments(src, C, seq_len, order), tile)
            for blk, rq, rk in blocks_of(my_segs, k_segs, scoring):
                grads = block_grads(blk, rq, rk, (q, ka, va, do, out, lse, D, low), fused_ok and same)
                gq, gk, gv = grads
                dq[..., rq, :] += gq
                dk[..., rk, :] += gk
                dv[..., rk, :] += gv
            if C == 1:
                incoming = (dkv, None)
                break
            # 5. add the partial gradient the previous ranks sent for this block (it travelled
            #    while this step computed) and pass it on; the last shift brings it home
            if incoming is not None:
                _wait(incoming[1])
                dkv += incoming[0]
            incoming = _shift(dkv, group)
            _wait(work_kv)
            if recv_kv is not None:
                kv = recv_kv
        _wait(incoming[1])
        dkv = incoming[0]
        dsink = sink_grad(sink, q, lse, D) if sink is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), dsink, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    causal: bool,
    softmax_scale: Optional[float] = None,
    layout: str = "sbhd",
    token_order: str = "load_balanced",
    attention_mask: Optional[torch.Tensor] = None,
    attention_bias: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    tile: Optional[int] = None,
):
    """Exact attention of this ring rank's tokens (``layout`` ``sbhd`` or ``bshd``, GQA
    allowed, value head dim may differ) against the whole sequence spread over ``group``
    (``None``: the whole sequence is here).  Differentiable in q, k, v, ``softmax_offset`` and
    the returned log-sum-exp (``attention_bias`` is a constant here).  ``cu_seqlens``: global
    document boundaries of a packed stream (``sbhd`` with b = 1); attention stays inside
    documents.  ``window_size=(left, right)``: query ``i`` sees keys ``i-left .. i+right`` (-1:
    unbounded), blocks outside it are skipped.  ``softmax_offset [hq]``: per-head sink logits.
    ``return_lse``: also the log-sum-exp, ``[Sq, b, hq]`` (``sbhd``) / ``[b, Sq, hq]`` (``bshd``),
    in float32 (float64 for float64 inputs).  ``tile``: see :class:`LseAttention`; default
    whole ring segments when every block takes the fused kernel, else ``LSE_TILE`` tokens."""
    sd = seq_dim(layout)
    C, _ = _ring_size(group)
    if C == 1:
        token_order = "contiguous"
    S = q.shape[sd] * C
    hq, hk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    to5 = (
        (lambda t, h, g: t.permute(1, 2, 0, 3).unflatten(1, (h, g)))
        if layout == "sbhd"
        else (lambda t, h, g: t.transpose(1, 2).unflatten(1, (h, g)))
    )
    q5, k5, v5 = to5(q, hk, hq // hk), to5(k, hk, 1), to5(v, hk, 1)
    docs = None
    if cu_seqlens is not None:  # the host boundaries decide which blocks meet; the ids mask the rest
        docs = (host_bounds(cu_seqlens), document_ids(cu_seqlens, S, q.device))
    window = attention_window(causal, window_size)
    scoring = Scoring(window, scale, attention_mask, attention_bias, docs)
    if tile is None and not call_is_fused(q, k.shape[-1] == v.shape[-1], scoring, window_size):
        tile = LSE_TILE  # the matmul engine: scores of one tile x tile block at a time
    out, lse = LseAttention.apply(q5, k5, v5, softmax_offset, RingWalk(group, scoring, S, token_order, tile))
    out, lse = out.flatten(1, 2), lse.flatten(1, 2)  # [b, hq, Sq, dv], [b, hq, Sq]
    if layout == "sbhd":
        out, lse = out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)
    else:
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out
