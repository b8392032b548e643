"""The tiled log-sum-exp engine: exact attention of this rank's queries against key blocks, merged
by log-sum-exp block after block (:mod:`ulysses_mcore.kernels.blocks` scores one block).  Plain
blocks run torch's fused flash kernel of the device; masks, bias, documents, windows, fp64 and
value heads of another size run the matmul form one ``LSE_TILE`` tile at a time.  Alone it is the
``sdpa`` backend's kernel for windows, sinks, MLA and a differentiable log-sum-exp; given a
:class:`~ulysses_mcore.kernels.ring.Ring` the key blocks travel round it (docs/design.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch

from ..exchange.heads import seq_dim
from ..exchange.orders import document_ids, host_bounds
from ..options import LSE_TILE
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


class Walk(NamedTuple):
    """One call's walk over the key blocks, fixed for the call: what every block's scores need
    (:class:`~ulysses_mcore.kernels.blocks.Scoring`), the whole sequence's length, the tile (None:
    segments whole) and the ring the keys travel round (None: the whole sequence is here; else an
    object with ``size``, ``rank``, ``segments(rank, seq_len)`` and ``shift(buf) -> (recv, work)``:
    :class:`ulysses_mcore.kernels.ring.Ring`)."""

    scoring: Scoring
    seq_len: int
    tile: Optional[int]
    ring: Any = None

    def size_rank(self) -> Tuple[int, int]:
        return (1, 0) if self.ring is None else (self.ring.size, self.ring.rank)

    def segments(self, rank: int, tile: Optional[int]) -> Segments:
        """The global positions rank ``rank`` holds, cut into tiles of ``tile`` tokens."""
        segs = [(0, self.seq_len)] if self.ring is None else self.ring.segments(rank, self.seq_len)
        return tile_segments(segs, tile)

    def shift(self, buf: torch.Tensor):
        """``buf`` passed on round the ring: ``(received, work)``."""
        return self.ring.shift(buf)


def _wait(work):
    if work is not None:
        work.wait()


class LseAttention(torch.autograd.Function):
    """``q [b, hk, g, Sq, d]``, ``k [b, hk, 1, Sk, d]``, ``v [b, hk, 1, Sk, dv]`` of this ring rank
    -> ``(out [b, hk, g, Sq, dv], lse [b, hk, g, Sq])``, both differentiable.

    ``walk.ring=None``: the whole sequence is here (the tiled single-rank kernel).  ``sink``
    (``[hk*g]`` logits or None): one extra key per head with score ``sink`` and value 0 -- the
    softmax's denominator gains ``exp(sink)`` (off-by-one: 0; learnable: a parameter).  ``tile``:
    query and key segments cut into tiles of that many tokens, so the scores held at once are
    ``[b, h, tile, tile]`` and tiles outside the window are never computed (``walk``: :class:`Walk`)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, walk: Walk):
        scoring, tile = walk.scoring, walk.tile
        C, me = walk.size_rank()
        acc = torch.promote_types(q.dtype, torch.float32)  # the merge's dtype (and the matmul engine's)
        d, same = k.shape[-1], k.shape[-1] == v.shape[-1]
        my_segs = walk.segments(me, tile)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1) if C > 1 else None
        for step in range(C):
            src = (me - step) % C
            recv, work = walk.shift(kv) if step < C - 1 else (None, None)
            ka, va = (k, v) if kv is None else (kv[..., :d], kv[..., d:])
            k_segs = walk.segments(src, tile)
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
        walk = ctx.walk
        C, me = walk.size_rank()
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
        tile = backward_tile(walk.tile, fused_ok and same)
        my_segs = walk.segments(me, tile)
        for step in range(C):
            src = (me - step) % C
            recv_kv, work_kv = walk.shift(kv) if step < C - 1 else (None, None)
            ka, va = kv[..., :d], kv[..., d:]
            dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)  # this rank's part for block src
            dk, dv = dkv[..., :d], dkv[..., d:]
            k_segs = walk.segments(src, tile)
            for blk, rq, rk in blocks_of(my_segs, k_segs, walk.scoring):
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
            incoming = walk.shift(dkv)
            _wait(work_kv)
            if recv_kv is not None:
                kv = recv_kv
        _wait(incoming[1])
        dkv = incoming[0]
        dsink = sink_grad(sink, q, lse, D) if sink is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), dsink, None


def lse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    layout: str = "sbhd",
    attention_mask: Optional[torch.Tensor] = None,
    attention_bias: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    tile: Optional[int] = None,
    ring: Any = None,
):
    """Exact attention of this rank's queries against the whole sequence, here or spread round a ring.

    Arguments:
        q: ``[S, b, hq, d]`` (``sbhd``) or ``[b, S, hq, d]`` (``bshd``), any float dtype.
        k, v: ``hk`` heads (``hq % hk == 0``), ``v`` of head dim ``dv`` (may differ from ``d``).
        causal, softmax_scale (default ``d**-0.5``), layout: as the backends take them.
        attention_mask: bool, True = masked, broadcastable to ``[b, hq, S_all, S_all]``; a constant.
        attention_bias: additive, same shape rule; a constant here.
        cu_seqlens: int32 ``[docs + 1]``, global document boundaries of a packed stream (b = 1).
        window_size: ``(left, right)``: query ``i`` sees keys ``i-left .. i+right`` (-1 unbounded).
        softmax_offset: ``[hq]`` per-head sink logits (differentiable).
        return_lse: also return the log-sum-exp, ``[S, b, hq]`` / ``[b, S, hq]``, fp32 (fp64 for fp64).
        tile: tokens per tile (:class:`LseAttention`); default whole segments when every block takes
            the fused kernel, else ``LSE_TILE``.
        ring: None (the whole sequence here) or a :class:`ulysses_mcore.kernels.ring.Ring`.
    Returns:
        ``out`` like ``q`` with head dim ``dv`` (and ``lse`` with ``return_lse``); differentiable in
        q, k, v, ``softmax_offset`` and the returned ``lse``."""
    S = q.shape[seq_dim(layout)] * (1 if ring is None else ring.size)
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
    out, lse = LseAttention.apply(q5, k5, v5, softmax_offset, Walk(scoring, S, tile, ring))
    out, lse = out.flatten(1, 2), lse.flatten(1, 2)  # [b, hq, Sq, dv], [b, hq, Sq]
    if layout == "sbhd":
        out, lse = out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)
    else:
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out
