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

import bisect
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .heads import seq_dim
from .transport import all_to_all
from .options import LSE_TILE, flash_takes_head_dim, has_window
from .orders import document_ids, host_bounds

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


def _doc_of(bounds, pos: int) -> int:
    """Document of position ``pos`` given the host boundaries ``[0, ..., total]``."""
    return bisect.bisect_right(bounds, pos) - 1


class _Block:
    """Scores of one (query segment, key segment) pair, masked, in the accumulation dtype."""

    def __init__(self, qseg, kseg, window: Window, scale, mask, bias, docs=None):
        (qs, qn), (ks, kn) = qseg, kseg
        left, right = window
        # hidden entirely: every key beyond every query's right reach, or before its left reach
        self.skip = (right is not None and ks > qs + qn - 1 + right) or (left is not None and ks + kn - 1 < qs - left)
        self.docs = None
        if docs is not None:  # packed documents: positions of different documents never meet
            bounds, ids = docs  # the boundaries on the host (decisions), document ids on the device (masks)
            q0, q1, k0, k1 = (_doc_of(bounds, p) for p in (qs, qs + qn - 1, ks, ks + kn - 1))
            self.skip = self.skip or k1 < q0 or k0 > q1
            if not (q0 == q1 == k0 == k1):
                self.docs = (ids[qs : qs + qn], ids[ks : ks + kn])
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
        """Whether a fused flash kernel (:func:`fused_kernel`) can take this block: one head dim, no
        mask, bias or document boundary inside it, and of the window only the causal triangle of an
        aligned diagonal block -- or, on CUDA, any window the kernel's own window arguments express
        (:meth:`flash_window`)."""
        kernel = fused_kernel(q, same_dims)
        if kernel is None:
            return False
        if self.mask is not None or self.bias is not None or self.docs is not None:
            return False
        if not self.windowed:
            return True
        if kernel == "cuda":
            return self.flash_window() is not None
        return not self.cut_left and self.window[1] == 0 and self.qs == self.ks and self.qn == self.kn

    def flash_window(self) -> Optional[Tuple[int, int]]:
        """The block's window as the CUDA flash kernel's ``(window_size_left, window_size_right)``
        (-1 unbounded), or ``None`` if it cannot say it.  The kernel aligns the last query with the
        last key: local query ``a`` sees local keys ``a + kn - qn - wl .. a + kn - qn + wr``; the
        block's global window is ``qs + a - left .. qs + a + right``."""
        left, right = self.window
        shift = self.qs - self.ks - (self.kn - self.qn)  # global offset of query a's key column
        wl = -1 if left is None else left - shift
        wr = -1 if right is None else right + shift
        if (left is not None and wl < 0) or (right is not None and wr < 0):
            return None
        return wl, wr

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
_CUDA_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
_CUDA_FLASH_BWD = getattr(torch.ops.aten, "_flash_attention_backward", None)
FUSED_DTYPES = {  # device type -> dtypes torch's fused flash kernel (with its log-sum-exp) takes
    "cpu": (torch.float32, torch.bfloat16),
    "cuda": (torch.float16, torch.bfloat16),
}


def fused_kernel(q, same_dims: bool = True) -> Optional[str]:
    """The fused flash kernel for blocks of ``q``'s device and dtype (``"cpu"`` / ``"cuda"``), or
    ``None``: torch's CPU flash kernel (fp32, bf16), torch's CUDA flash kernel (fp16, bf16, head
    dim <= 256).  Blocks run in the input dtype; only the merge accumulates in fp32."""
    dev = q.device.type
    if not same_dims or q.dtype not in FUSED_DTYPES.get(dev, ()):
        return None
    if dev == "cpu":
        return "cpu" if _CPU_FLASH is not None else None
    return "cuda" if _CUDA_FLASH is not None and flash_takes_head_dim(q.shape[-1]) else None


def call_is_fused(q, same_dims: bool, mask, bias, docs, window_size) -> bool:
    """Whether every block of a call can take the fused kernel (then segments run whole, else the
    matmul engine's blocks are tiled to ``LSE_TILE`` tokens).  A window: on CUDA only, where the
    flash kernel takes it as its own arguments (:meth:`_Block.flash_window`)."""
    plain = mask is None and bias is None and docs is None
    kernel = fused_kernel(q, same_dims)
    return plain and kernel is not None and (kernel == "cuda" or not has_window(window_size))


def _expand4(t, g):
    """``[b, hk, 1, n, d]`` -> ``[b, hk*g, n, d]`` (kv heads repeated for their query heads)."""
    b, hk, _, n, d = t.shape
    return t.expand(b, hk, g, n, d).reshape(b, hk * g, n, d)


def _fused_forward(q, k, v, blk):
    """One block through the fused flash kernel of its device: (out in q's dtype, lse in fp32)."""
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, blk)
    b, hk, g, n, d = q.shape
    out, lse = _CPU_FLASH(
        q.reshape(b, hk * g, n, d), _expand4(k, g), _expand4(v, g), 0.0, blk.windowed, scale=blk.scale
    )
    return out.view(b, hk, g, n, d), lse.view(b, hk, g, n)


def _seq_starts(b: int, n: int, device) -> torch.Tensor:
    """``[0, n, 2n, ..., b*n]`` (int32): ``b`` sequences of ``n`` tokens for the varlen kernel."""
    return torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=device)


def _varlen_rows(t):
    """``[b, h, g, n, d]`` -> ``[b*n, h*g, d]`` (the CUDA flash kernel's packed layout; GQA native)."""
    b, h, g, n, d = t.shape
    return t.permute(0, 3, 1, 2, 4).reshape(b * n, h * g, d)


def _cuda_forward(q, k, v, blk):
    """One block through torch's CUDA flash kernel (the varlen form, whose backward takes the final
    out and lse): ``(out [b, hk, g, n, dv]`` in q's dtype, ``lse [b, hk, g, n]`` fp32)."""
    b, hk, g, n, d = q.shape
    kn = k.shape[3]
    out, lse = _CUDA_FLASH(
        _varlen_rows(q),
        _varlen_rows(k),
        _varlen_rows(v),
        _seq_starts(b, n, q.device),
        _seq_starts(b, kn, q.device),
        n,
        kn,
        0.0,
        return_debug_mask=False,
        **_cuda_window(blk),
    )[:2]
    return out.view(b, n, hk, g, -1).permute(0, 2, 3, 1, 4), lse.view(hk, g, b, n).permute(2, 0, 1, 3)


def _cuda_window(blk) -> dict:
    """The CUDA flash kernel's ``is_causal``, scale and window keywords for a block: a block with no
    pair outside the window runs unwindowed, the causal triangle as ``is_causal``, any other window
    through the kernel's own window arguments."""
    kw = dict(is_causal=False, scale=blk.scale)
    if blk.windowed:
        window = blk.flash_window()
        if window == (-1, 0):
            kw["is_causal"] = True
        else:
            kw["window_size_left"], kw["window_size_right"] = window
    return kw


def _cuda_backward(do, q, k, v, out, lse, blk):
    b, hk, g, n, d = q.shape
    kn = k.shape[3]
    gq, gk, gv = _CUDA_FLASH_BWD(
        _varlen_rows(do),
        _varlen_rows(q),
        _varlen_rows(k),
        _varlen_rows(v),
        _varlen_rows(out),
        lse.permute(1, 2, 0, 3).reshape(hk * g, b * n).contiguous(),
        _seq_starts(b, n, q.device),
        _seq_starts(b, kn, q.device),
        n,
        kn,
        0.0,
        rng_state=torch.zeros(2, dtype=torch.uint64, device=q.device),  # no dropout
        unused=torch.empty(0, device=q.device),
        **_cuda_window(blk),
    )
    return (
        gq.view(b, n, hk, g, d).permute(0, 2, 3, 1, 4),
        gk.view(b, kn, hk, 1, d).permute(0, 2, 3, 1, 4),
        gv.view(b, kn, hk, 1, -1).permute(0, 2, 3, 1, 4),
    )


def _fused_backward(do, q, k, v, out, lse, blk):
    """Gradients of one block given the *final* out and lse (exact for a block of a ring), all in
    q's dtype but the lse."""
    if q.device.type == "cuda":
        return _cuda_backward(do, q, k, v, out, lse, blk)
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
    q, k, v, do, out, lse, D, low = tensors
    if fused_ok and blk.fused(q, True):  # the fused kernel's backward (input dtype), fed the final out and lse
        do_in, out_in = low
        return _fused_backward(
            do_in[..., rq, :], q[..., rq, :], k[..., rk, :], v[..., rk, :], out_in[..., rq, :], lse[..., rq], blk
        )
    acc = out.dtype  # the matmul engine: one tile at a time in the accumulation dtype
    qa, ka, va = q[..., rq, :].to(acc), k[..., rk, :].to(acc), v[..., rk, :].to(acc)
    # 2. recompute probabilities with the final lse
    p = _safe_exp_diff(blk.scores(qa, ka), lse[..., rq, None])
    # 3. dV = P^T dO ; dP = dO V^T ; dS = P (dP - D)
    gv = torch.matmul(p.transpose(-1, -2), do[..., rq, :]).sum(2, keepdim=True)
    ds = p * (torch.matmul(do[..., rq, :], va.transpose(-1, -2)) - D[..., rq, None])
    # 4. dQ = dS K * scale ; dK = dS^T Q * scale (summed over the query group)
    gq = torch.matmul(ds, ka) * scale
    gk = (torch.matmul(ds.transpose(-1, -2), qa) * scale).sum(2, keepdim=True)
    return gq, gk, gv


def _sink_grad(sink, q, lse, D):
    """The sink column: p = exp(sink - lse), dP = dO . 0 = 0, so dS = -p D (this rank's rows)."""
    s5 = sink.detach().to(lse.dtype).view(1, *q.shape[1:3], 1)
    return -(_safe_exp_diff(s5.expand_as(lse), lse) * D).sum((0, 3)).reshape(-1).to(sink.dtype)


def _backward_tile(tile, fused: bool):
    """The backward's tiles: the forward's, or -- where the forward fused a call whole but its backward
    runs the matmul engine (a gradient of the lse) -- ``LSE_TILE`` tokens, one tile of scores at a time."""
    return tile if fused or tile else LSE_TILE


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
            for blk, rq, rk in _blocks(my_segs, k_segs, window, scale, mask, bias, docs):
                if blk.fused(q, same):  # the input dtype through the fused kernel; its lse is fp32
                    b_out, b_lse = _fused_forward(q[..., rq, :], ka[..., rk, :], va[..., rk, :], blk)
                    b_out, b_lse = b_out.to(acc), b_lse.to(acc)
                else:  # one tile in the accumulation dtype
                    s = blk.scores(q[..., rq, :].to(acc), ka[..., rk, :].to(acc))
                    b_lse = torch.logsumexp(s, dim=-1)
                    p = _safe_exp_diff(s, b_lse[..., None])
                    b_out = torch.matmul(p, va[..., rk, :].to(acc))
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
            s5 = sink.detach().to(acc).view(1, *q.shape[1:3], 1)
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
        tile = _backward_tile(tile, fused_ok and same)
        my_segs = tile_segments(ring_segments(me, C, seq_len, order), tile)
        for step in range(C):
            src = (me - step) % C
            recv_kv, work_kv = _shift(kv, group) if step < C - 1 else (None, None)
            ka, va = kv[..., :d], kv[..., d:]
            dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)  # this rank's part for block src
            dk, dv = dkv[..., :d], dkv[..., d:]
            k_segs = tile_segments(ring_segments(src, C, seq_len, order), tile)
            for blk, rq, rk in _blocks(my_segs, k_segs, window, scale, ctx.mask, ctx.bias, ctx.docs):
                grads = _block_grads(blk, rq, rk, (q, ka, va, do, out, lse, D, low), scale, fused_ok and same)
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
        dsink = _sink_grad(sink, q, lse, D) if sink is not None and ctx.needs_input_grad[3] else None
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
    if tile is None and not call_is_fused(
        q, k.shape[-1] == v.shape[-1], attention_mask, attention_bias, docs, window_size
    ):
        tile = LSE_TILE  # the matmul engine: scores of one tile x tile block at a time
    out, lse = LseAttention.apply(
        q5, k5, v5, softmax_offset, group, window, scale, S, token_order, attention_mask, attention_bias, docs, tile
    )
    out, lse = out.flatten(1, 2), lse.flatten(1, 2)  # [b, hq, Sq, dv], [b, hq, Sq]
    if layout == "sbhd":
        out, lse = out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)
    else:
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out
