"""Ring attention over the ring context-parallel group, merging partial results by log-sum-exp.

Used by the hybrid Ulysses x ring path: after the Ulysses all-to-all a rank holds, for its
band of heads, the tokens of its *ring* shard; the ring then passes key/value blocks around
the ``cp`` group so every query meets every key.  On GPU the same job is Transformer
Engine's p2p context parallelism (``backend="te"``); this module is the portable version
(CPU/gloo, or any backend), written with plain matmuls so it is exact and testable here.

Blocks without a mask, bias or document boundary run through torch's fused CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp the merge
needs, and its backward fed the final output and log-sum-exp); the rest, and other devices
and dtypes, through the matmul form below.

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

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .exchange import all_to_all, seq_dim
from .options import LSE_TILE, has_window
from .orders import document_ids

Segments = List[Tuple[int, int]]  # (first global position, length)


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


Window = Tuple[Optional[int], Optional[int]]  # (left, right) reach; None = unbounded


def attention_window(causal: bool, window_size) -> Window:
    """The keys a query may see, ``i - left <= j <= i + right`` (Megatron's / TE's / flash-attn's
    ``window_size`` convention, -1 = unbounded), with causality folded in as ``right <= 0``."""
    left, right = window_size if window_size is not None else (-1, -1)
    left = None if left < 0 else left
    right = None if right < 0 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def tile_segments(segs: Segments, tile: Optional[int]) -> Segments:
    """Segments cut into pieces of at most ``tile`` tokens (``None``: as they are)."""
    if not tile:
        return segs
    return [(s + a, min(tile, n - a)) for s, n in segs for a in range(0, n, tile)]


def _rows(t: torch.Tensor, r: slice) -> torch.Tensor:
    return t if t.shape[-2] == 1 else t[..., r, :]  # a mask/bias broadcast over query rows


class _Block:
    """Scores of one (query segment, key segment) pair, masked, in the accumulation dtype."""

    def __init__(self, qseg, kseg, window: Window, scale, mask, bias, docs=None):
        (qs, qn), (ks, kn) = qseg, kseg
        left, right = window
        # hidden entirely: every key beyond every query's right reach, or before its left reach
        self.skip = (right is not None and ks > qs + qn - 1 + right) or (left is not None and ks + kn - 1 < qs - left)
        self.docs = None
        if docs is not None:  # packed documents: positions of different documents never meet
            qd, kd = docs[qs : qs + qn], docs[ks : ks + kn]
            self.skip = self.skip or bool(kd[-1] < qd[0]) or bool(kd[0] > qd[-1])
            if not (qd[0] == qd[-1] == kd[0] == kd[-1]):
                self.docs = (qd, kd)
        self.qs, self.qn, self.ks, self.kn = qs, qn, ks, kn
        self.cut_right = not self.skip and right is not None and ks + kn - 1 > qs + right
        self.cut_left = not self.skip and left is not None and ks < qs + qn - 1 - left
        self.window = window
        self.scale, self.mask, self.bias = scale, mask, bias

    @property
    def windowed(self) -> bool:
        """Some (query, key) pair inside the block lies outside the window."""
        return self.cut_right or self.cut_left

    def fused(self, q, same_dims: bool = True) -> bool:
        """Whether torch's fused CPU flash kernel can take this block: fp32 on the CPU, one head
        dim, no mask, bias or document boundary inside it, and of the window only the causal
        triangle of an aligned diagonal block."""
        if _CPU_FLASH is None or q.device.type != "cpu" or q.dtype != torch.float32 or not same_dims:
            return False
        if self.mask is not None or self.bias is not None or self.docs is not None:
            return False
        if not self.windowed:
            return True
        return not self.cut_left and self.window[1] == 0 and self.qs == self.ks and self.qn == self.kn

    def scores(self, q, k):
        """``q [b, hk, g, qn, d]``, ``k [b, hk, 1, kn, d]`` -> ``[b, hk, g, qn, kn]``, -inf where masked."""
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        b, hk, g, qn, kn = s.shape
        rq, rk = slice(self.qs, self.qs + qn), slice(self.ks, self.ks + kn)
        if self.bias is not None:
            s = s + _heads5(_rows(self.bias[..., rk], rq), hk, g).to(s.dtype)
        allowed = None
        if self.windowed:
            qp = torch.arange(self.qs, self.qs + qn, device=s.device)[:, None]
            kp = torch.arange(self.ks, self.ks + kn, device=s.device)[None, :]
            left, right = self.window
            if self.cut_right:
                allowed = kp <= qp + right
            if self.cut_left:
                inside = kp >= qp - left
                allowed = inside if allowed is None else (allowed & inside)
        if self.docs is not None:
            same = self.docs[0][:, None] == self.docs[1][None, :]
            allowed = same if allowed is None else (allowed & same)
        if self.mask is not None:
            m = _heads5(_rows(self.mask[..., rk], rq), hk, g)
            allowed = ~m if allowed is None else (allowed & ~m)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        return s


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _expand4(t, g):
    """``[b, hk, 1, n, d]`` -> ``[b, hk*g, n, d]`` (kv heads repeated for their query heads)."""
    b, hk, _, n, d = t.shape
    return t.expand(b, hk, g, n, d).reshape(b, hk * g, n, d)


def _fused_forward(q, k, v, blk):
    """One block through torch's fused CPU flash kernel: (out, lse) like the matmul path."""
    b, hk, g, n, d = q.shape
    out, lse = _CPU_FLASH(
        q.reshape(b, hk * g, n, d), _expand4(k, g), _expand4(v, g), 0.0, blk.windowed, scale=blk.scale
    )
    return out.view(b, hk, g, n, d), lse.view(b, hk, g, n)


def _fused_backward(do, q, k, v, out, lse, blk):
    """Gradients of one block given the *final* out and lse (exact for a block of a ring)."""
    b, hk, g, n, d = q.shape
    flat = lambda t: t.reshape(b, hk * g, *t.shape[3:])  # noqa: E731
    gq, gk, gv = _CPU_FLASH_BWD(
        flat(do),
        flat(q),
        _expand4(k, g),
        _expand4(v, g),
        flat(out),
        flat(lse).contiguous(),
        0.0,
        blk.windowed,
        scale=blk.scale,
    )
    kn = k.shape[3]
    return (
        gq.view(b, hk, g, n, d),
        gk.view(b, hk, g, kn, d).sum(2, keepdim=True),
        gv.view(b, hk, g, kn, d).sum(2, keepdim=True),
    )


def _heads5(t: torch.Tensor, hk: int, g: int) -> torch.Tensor:
    """A ``[b|1, h|1, qn|1, kn]`` mask/bias slice -> ``[b|1, hk|1, g|1, qn|1, kn]``."""
    if t.shape[1] == 1:
        return t.unsqueeze(1)
    return t.unflatten(1, (hk, g))


def _blocks(q_segs: Segments, k_segs: Segments, window: Window, scale, mask, bias, docs):
    """The (query segment, key segment) blocks that are not hidden entirely, with the slices of
    the local query rows and of the key block they cover: ``(block, rows, cols)``."""
    koff = 0
    for kseg in k_segs:
        qoff = 0
        for qseg in q_segs:
            blk = _Block(qseg, kseg, window, scale, mask, bias, docs)
            if not blk.skip:
                yield blk, slice(qoff, qoff + qseg[1]), slice(koff, koff + kseg[1])
            qoff += qseg[1]
        koff += kseg[1]


def _safe_exp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a - b), 0 where ``a`` is -inf (also when ``b`` is -inf)."""
    return torch.where(torch.isinf(a) & (a < 0), torch.zeros_like(a), torch.exp(a - b))


def _ring_size(group) -> Tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def _block_grads(blk, rq, rk, tensors, scale, fused_ok: bool):
    """(dq, dk, dv) of one (query segment, key segment) block, given the final out and lse."""
    qa, ka, va, do, out, lse, D = tensors
    if fused_ok and blk.fused(qa, True):  # the fused kernel's backward, fed the final out and lse
        return _fused_backward(
            do[..., rq, :], qa[..., rq, :], ka[..., rk, :], va[..., rk, :], out[..., rq, :], lse[..., rq], blk
        )
    # 2. recompute probabilities with the final lse
    p = _safe_exp_diff(blk.scores(qa[..., rq, :], ka[..., rk, :]), lse[..., rq, None])
    # 3. dV = P^T dO ; dP = dO V^T ; dS = P (dP - D)
    gv = torch.matmul(p.transpose(-1, -2), do[..., rq, :]).sum(2, keepdim=True)
    ds = p * (torch.matmul(do[..., rq, :], va[..., rk, :].transpose(-1, -2)) - D[..., rq, None])
    # 4. dQ = dS K * scale ; dK = dS^T Q * scale (summed over the query group)
    gq = torch.matmul(ds, ka[..., rk, :]) * scale
    gk = (torch.matmul(ds.transpose(-1, -2), qa[..., rq, :]) * scale).sum(2, keepdim=True)
    return gq, gk, gv


def _sink_grad(sink, qa, lse, D):
    """The sink column: p = exp(sink - lse), dP = dO . 0 = 0, so dS = -p D (this rank's rows)."""
    s5 = sink.detach().to(qa.dtype).view(1, *qa.shape[1:3], 1)
    return -(_safe_exp_diff(s5.expand_as(lse), lse) * D).sum((0, 3)).reshape(-1).to(sink.dtype)


class LseAttention(torch.autograd.Function):
    """``q [b, hk, g, Sq, d]``, ``k [b, hk, 1, Sk, d]``, ``v [b, hk, 1, Sk, dv]`` of this ring rank
    -> ``(out [b, hk, g, Sq, dv], lse [b, hk, g, Sq])``, both differentiable.

    ``group=None``: no ring, the whole sequence is here (the tiled single-rank kernel).  ``sink``
    (``[hk*g]`` logits or None): one extra key per head with score ``sink`` and value 0 -- the
    softmax's denominator gains ``exp(sink)`` (off-by-one: 0; learnable: a parameter).  ``tile``:
    query and key segments cut into tiles of that many tokens, so the scores held at once are
    ``[b, h, tile, tile]`` and tiles outside the window are never computed."""

    @staticmethod
    def forward(ctx, q, k, v, sink, group, window, scale, seq_len, token_order, mask, bias, docs, tile):
        C, me = _ring_size(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = q.to(acc)
        d, same = k.shape[-1], k.shape[-1] == v.shape[-1]
        my_segs = tile_segments(ring_segments(me, C, seq_len, token_order), tile)
        out = torch.zeros((*qa.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full(qa.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1) if C > 1 else None
        for step in range(C):
            src = (me - step) % C
            recv, work = _shift(kv, group) if step < C - 1 else (None, None)
            ka, va = (k.to(acc), v.to(acc)) if kv is None else (kv[..., :d].to(acc), kv[..., d:].to(acc))
            k_segs = tile_segments(ring_segments(src, C, seq_len, token_order), tile)
            for blk, rq, rk in _blocks(my_segs, k_segs, window, scale, mask, bias, docs):
                if blk.fused(qa, same):
                    b_out, b_lse = _fused_forward(qa[..., rq, :], ka[..., rk, :], va[..., rk, :], blk)
                else:
                    s = blk.scores(qa[..., rq, :], ka[..., rk, :])
                    b_lse = torch.logsumexp(s, dim=-1)
                    p = _safe_exp_diff(s, b_lse[..., None])
                    b_out = torch.matmul(p, va[..., rk, :])
                new = torch.logaddexp(lse[..., rq], b_lse)
                out[..., rq, :] = (
                    out[..., rq, :] * _safe_exp_diff(lse[..., rq], new)[..., None]
                    + b_out * _safe_exp_diff(b_lse, new)[..., None]
                )
                lse[..., rq] = new
            _wait(work)
            if recv is not None:
                kv = recv
        if sink is not None:  # the sink: one more key of score `sink` and value 0 per head
            s5 = sink.detach().to(acc).view(1, *qa.shape[1:3], 1)
            new = torch.logaddexp(lse, s5)
            out *= _safe_exp_diff(lse, new)[..., None]
            lse = new
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.group, ctx.window, ctx.scale, ctx.seq_len, ctx.token_order = group, window, scale, seq_len, token_order
        ctx.mask, ctx.bias, ctx.docs, ctx.tile = mask, bias, docs, tile
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse.detach().clone()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        group, window, scale, seq_len, order, tile = (
            ctx.group,
            ctx.window,
            ctx.scale,
            ctx.seq_len,
            ctx.token_order,
            ctx.tile,
        )
        C, me = _ring_size(group)
        acc = out.dtype
        d, same = k.shape[-1], k.shape[-1] == v.shape[-1]
        qa = q.to(acc)
        do = torch.zeros_like(out) if dout is None else dout.to(acc)
        # 1. D_i = sum_d dO_i O_i - dlse_i: the softmax backward's row term (d lse_i / d s_ij = p_ij)
        D = (do * out).sum(-1)
        if dlse is not None:
            D = D - dlse.to(acc)
        fused_ok = dlse is None  # the fused backward computes D itself, without the lse term
        dq = torch.zeros_like(qa)
        kv = torch.cat([k, v], dim=-1)
        incoming = None  # (buffer, work): the partial dk/dv of the block computed next, in flight
        my_segs = tile_segments(ring_segments(me, C, seq_len, order), tile)
        for step in range(C):
            src = (me - step) % C
            recv_kv, work_kv = _shift(kv, group) if step < C - 1 else (None, None)
            ka, va = kv[..., :d].to(acc), kv[..., d:].to(acc)
            dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)  # this rank's part for block src
            dk, dv = dkv[..., :d], dkv[..., d:]
            k_segs = tile_segments(ring_segments(src, C, seq_len, order), tile)
            for blk, rq, rk in _blocks(my_segs, k_segs, window, scale, ctx.mask, ctx.bias, ctx.docs):
                gq, gk, gv = _block_grads(blk, rq, rk, (qa, ka, va, do, out, lse, D), scale, fused_ok and same)
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
        dsink = _sink_grad(sink, qa, lse, D) if sink is not None and ctx.needs_input_grad[3] else None
        return (dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), dsink) + (None,) * 9


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
    whole ring segments, or ``LSE_TILE`` tokens with a window."""
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
    if cu_seqlens is not None:
        docs = document_ids(cu_seqlens, S, q.device)
    window = attention_window(causal, window_size)
    if tile is None and has_window(window_size):
        tile = LSE_TILE
    out, lse = LseAttention.apply(
        q5, k5, v5, softmax_offset, group, window, scale, S, token_order, attention_mask, attention_bias, docs, tile
    )
    out, lse = out.flatten(1, 2), lse.flatten(1, 2)  # [b, hq, Sq, dv], [b, hq, Sq]
    if layout == "sbhd":
        out, lse = out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)
    else:
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out
