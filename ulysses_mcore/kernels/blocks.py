"""One block of the log-sum-exp engine: a (query segment, key segment) pair's window and mask
(:class:`Block`), torch's fused flash kernel of the device where it applies (:func:`fused_kernel`)
and the matmul form's gradients given the final output and log-sum-exp (:func:`block_grads`).
"""

from __future__ import annotations

import bisect
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from ..options import LSE_TILE, flash_takes_head_dim, has_window

Segments = List[Tuple[int, int]]  # (first global position, length)


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


class Scoring(NamedTuple):
    """What every block's scores need besides its segments, fixed for one call: the window, the
    softmax scale, the mask and bias (``[b|1, h|1, sq|1, sk]`` or None) and the packed documents
    (host boundaries, device document ids) or None."""

    window: Window
    scale: float
    mask: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    docs: Any = None


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


class Block:
    """Scores of one (query segment, key segment) pair, masked, in the accumulation dtype."""

    def __init__(self, qseg, kseg, scoring: Scoring):
        (qs, qn), (ks, kn) = qseg, kseg
        window, scale, mask, bias, docs = scoring
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


def call_is_fused(q, same_dims: bool, scoring: Scoring, window_size) -> bool:
    """Whether every block of a call can take the fused kernel (then segments run whole, else the
    matmul engine's blocks are tiled to ``LSE_TILE`` tokens).  A window: on CUDA only, where the
    flash kernel takes it as its own arguments (:meth:`Block.flash_window`)."""
    plain = scoring.mask is None and scoring.bias is None and scoring.docs is None
    kernel = fused_kernel(q, same_dims)
    return plain and kernel is not None and (kernel == "cuda" or not has_window(window_size))


def _expand4(t, g):
    """``[b, hk, 1, n, d]`` -> ``[b, hk*g, n, d]`` (kv heads repeated for their query heads)."""
    b, hk, _, n, d = t.shape
    return t.expand(b, hk, g, n, d).reshape(b, hk * g, n, d)


def fused_forward(q, k, v, blk):
    """One block through the fused flash kernel of its device: (out in q's dtype, lse in fp32)."""
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, blk)
    b, hk, g, n, d = q.shape
    out, lse = _CPU_FLASH(
        q.reshape(b, hk * g, n, d), _expand4(k, g), _expand4(v, g), 0.0, blk.windowed, scale=blk.scale
    )
    return out.view(b, hk, g, n, d), lse.view(b, hk, g, n)


def _varlen_keywords(b: int, n: int, kn: int, device) -> dict:
    """The CUDA varlen flash kernel's sequence keywords for ``b`` sequences of ``n`` queries and
    ``kn`` keys (boundaries ``[0, n, 2n, ..., b*n]``, int32), no dropout."""
    starts = lambda m: torch.arange(0, (b + 1) * m, m, dtype=torch.int32, device=device)  # noqa: E731
    return dict(cum_seq_q=starts(n), cum_seq_k=starts(kn), max_q=n, max_k=kn, dropout_p=0.0)


def _varlen_rows(t):
    """``[b, h, g, n, d]`` -> ``[b*n, h*g, d]`` (the CUDA flash kernel's packed layout; GQA native)."""
    b, h, g, n, d = t.shape
    return t.permute(0, 3, 1, 2, 4).reshape(b * n, h * g, d)


def _cuda_forward(q, k, v, blk):
    """One block through torch's CUDA flash kernel (the varlen form, whose backward takes the final
    out and lse): ``(out [b, hk, g, n, dv]`` in q's dtype, ``lse [b, hk, g, n]`` fp32)."""
    b, hk, g, n, d = q.shape
    kn = k.shape[3]
    rows = (_varlen_rows(t) for t in (q, k, v))
    kw = _varlen_keywords(b, n, kn, q.device) | _cuda_window(blk)
    out, lse = _CUDA_FLASH(*rows, return_debug_mask=False, **kw)[:2]
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


def _cuda_backward(blk, tensors):
    do, q, k, v, out, lse = tensors
    b, hk, g, n, d = q.shape
    kn = k.shape[3]
    rows = (_varlen_rows(t) for t in (do, q, k, v, out))
    kw = _varlen_keywords(b, n, kn, q.device) | _cuda_window(blk)
    kw |= dict(rng_state=torch.zeros(2, dtype=torch.uint64, device=q.device), unused=torch.empty(0, device=q.device))
    gq, gk, gv = _CUDA_FLASH_BWD(*rows, logsumexp=lse.permute(1, 2, 0, 3).reshape(hk * g, b * n).contiguous(), **kw)
    return (
        gq.view(b, n, hk, g, d).permute(0, 2, 3, 1, 4),
        gk.view(b, kn, hk, 1, d).permute(0, 2, 3, 1, 4),
        gv.view(b, kn, hk, 1, -1).permute(0, 2, 3, 1, 4),
    )


def _fused_backward(blk, tensors):
    """Gradients of one block given ``tensors = (do, q, k, v, out, lse)`` with the *final* out and lse
    (exact for a block of a ring), all in q's dtype but the lse."""
    do, q, k, v, out, lse = tensors
    if q.device.type == "cuda":
        return _cuda_backward(blk, tensors)
    b, hk, g, n, d = q.shape
    flat = lambda t: t.reshape(b, hk * g, *t.shape[3:])  # noqa: E731
    rows = (flat(do), flat(q), _expand4(k, g), _expand4(v, g), flat(out))
    kw = dict(logsumexp=flat(lse).contiguous(), dropout_p=0.0, is_causal=blk.windowed, scale=blk.scale)
    gq, gk, gv = _CPU_FLASH_BWD(*rows, **kw)
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


def blocks_of(q_segs: Segments, k_segs: Segments, scoring: Scoring):
    """The (query segment, key segment) blocks that are not hidden entirely, with the slices of
    the local query rows and of the key block they cover: ``(block, rows, cols)``."""
    koff = 0
    for kseg in k_segs:
        qoff = 0
        for qseg in q_segs:
            blk = Block(qseg, kseg, scoring)
            if not blk.skip:
                yield blk, slice(qoff, qoff + qseg[1]), slice(koff, koff + kseg[1])
            qoff += qseg[1]
        koff += kseg[1]


def safe_exp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a - b), 0 where ``a`` is -inf (also when ``b`` is -inf)."""
    return torch.where(torch.isinf(a) & (a < 0), torch.zeros_like(a), torch.exp(a - b))


def block_grads(blk, rq, rk, tensors, fused_ok: bool):
    """(dq, dk, dv) of one (query segment, key segment) block, given the final out and lse."""
    q, k, v, do, out, lse, D, low = tensors
    if fused_ok and blk.fused(q, True):  # the fused kernel's backward (input dtype), fed the final out and lse
        do_in, out_in = low
        rows = (do_in[..., rq, :], q[..., rq, :], k[..., rk, :], v[..., rk, :], out_in[..., rq, :], lse[..., rq])
        return _fused_backward(blk, rows)
    acc = out.dtype  # the matmul engine: one tile at a time in the accumulation dtype
    qa, ka, va = q[..., rq, :].to(acc), k[..., rk, :].to(acc), v[..., rk, :].to(acc)
    # 2. recompute probabilities with the final lse
    p = safe_exp_diff(blk.scores(qa, ka), lse[..., rq, None])
    # 3. dV = P^T dO ; dP = dO V^T ; dS = P (dP - D)
    gv = torch.matmul(p.transpose(-1, -2), do[..., rq, :]).sum(2, keepdim=True)
    ds = p * (torch.matmul(do[..., rq, :], va.transpose(-1, -2)) - D[..., rq, None])
    # 4. dQ = dS K * scale ; dK = dS^T Q * scale (summed over the query group)
    gq = torch.matmul(ds, ka) * blk.scale
    gk = (torch.matmul(ds.transpose(-1, -2), qa) * blk.scale).sum(2, keepdim=True)
    return gq, gk, gv


def sink_grad(sink, q, lse, D):
    """The sink column: p = exp(sink - lse), dP = dO . 0 = 0, so dS = -p D (this rank's rows)."""
    s5 = sink.detach().to(lse.dtype).view(1, *q.shape[1:3], 1)
    return -(safe_exp_diff(s5.expand_as(lse), lse) * D).sum((0, 3)).reshape(-1).to(sink.dtype)


def backward_tile(tile, fused: bool):
    """The backward's tiles: the forward's, or -- where the forward fused a call whole but its backward
    runs the matmul engine (a gradient of the lse) -- ``LSE_TILE`` tokens, one tile of scores at a time."""
    return tile if fused or tile else LSE_TILE
