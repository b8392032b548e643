"""The exchange: the one pair of autograd all-to-alls between token-sharded and head-sharded.

A (token, head) cell has an owner.  Outside core attention rank ``r`` of a Ulysses group of
size ``P`` owns tokens ``r*s/P ... (r+1)*s/P - 1`` with every head; inside it, every token with
a band of heads.  Two collectives move ownership:

``SeqToHead``  q, k, v ``[s/P, b, h, d]``  ->  ``[s, b, h_r, d]``   (ONE all_to_all_single)
``HeadToSeq``  out      ``[s, b, h_r, d]``  ->  ``[s/P, b, h, d]``  (ONE all_to_all_single)

Everything about *which* heads go where is one :class:`HeadPlan`: per destination rank ``j``
a range of query heads (``h/P`` each when ``P`` divides ``h``, else the first ``h % P`` ranks
one more -- 7 heads at P = 4 compute 2, 2, 2, 1, no padded heads) and the range of kv heads
those query heads use (query heads of one kv group are contiguous in Megatron's QKV layout).
A kv head needed by several ranks is sent to each and the backward sums the copies.  The
all-to-alls carry the plan's per-rank split sizes; when they are all equal (``uniform``) the
collective is the plain even one.  Q, K and V cross in one packed buffer: block ``j`` holds
rank ``j``'s query heads followed by its kv heads, so the received buffer *is* the attention
input (``sbhd``: source rank == token block, a view, zero copies).

Copies per direction (each touches every element once): pack 1, unpack 0 (``sbhd``) or 1
(``bshd`` with b > 1); the output: pack 0-1, unpack 1; the backward mirrors it.

Single-rank references: :func:`reference_seq_to_head` (pure indexing, no collective); the
exchange is tested against it and ``head_to_seq`` as its exact inverse.  Layout logic lives in
:func:`seq_dim` and the two ``_recv_as_layout`` / ``_layout_as_chunks`` helpers only.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

LAYOUTS = ("sbhd", "bshd")


def seq_dim(layout: str) -> int:
    """The sequence dim of a 4-D tensor in ``layout`` (``thd`` runs as ``sbhd`` with b = 1)."""
    return 1 if layout == "bshd" else 0


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class HeadPlan:
    """Which heads go to which rank, for ``num_q_heads`` / ``num_kv_heads`` over ``degree`` ranks."""

    num_q_heads: int
    num_kv_heads: int
    degree: int

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def q_range(self, rank: int) -> Tuple[int, int]:
        base, extra = divmod(self.num_q_heads, self.degree)
        first = rank * base + min(rank, extra)
        return first, first + base + (1 if rank < extra else 0)

    def kv_range(self, rank: int) -> Tuple[int, int]:
        lo, hi = self.q_range(rank)
        return lo // self.group_size, (hi - 1) // self.group_size + 1

    def q_count(self, rank: int) -> int:
        lo, hi = self.q_range(rank)
        return hi - lo

    def kv_count(self, rank: int) -> int:
        lo, hi = self.kv_range(rank)
        return hi - lo

    def chunk_heads(self, rank: int) -> int:
        return self.q_count(rank) + 2 * self.kv_count(rank)

    @cached_property
    def regular(self) -> bool:
        """Every rank the same number of query heads and either ``kv/P`` kv heads each (scatter)
        or one kv head shared by ``P/kv`` consecutive ranks (replication): packed in one strided
        copy per tensor."""
        hq, hk, P = self.num_q_heads, self.num_kv_heads, self.degree
        return hq % P == 0 and (hk % P == 0 or P % hk == 0)

    @cached_property
    def uniform(self) -> bool:
        """All split sizes equal: the all-to-all needs no split sizes."""
        return len({(self.q_count(j), self.kv_count(j)) for j in range(self.degree)}) == 1

    @property
    def kv_replicas(self) -> int:
        """Regular plans: how many consecutive ranks receive the same kv head (1 = scatter)."""
        return self.degree // self.num_kv_heads if self.num_kv_heads < self.degree else 1

    def kv_index_for_q(self, rank: int) -> Optional[List[int]]:
        """Local kv head of each local query head when the local heads are not an ordinary GQA
        layout (a rank's query heads start inside a kv group), else ``None``."""
        lo, hi = self.q_range(rank)
        g, nkv = self.group_size, self.kv_count(rank)
        if nkv == 1 or (lo % g == 0 and (hi - lo) % g == 0):
            return None
        return [q // g - lo // g for q in range(lo, hi)]

    def kv_heads_of_rank(self, rank: int) -> List[int]:
        return list(range(*self.kv_range(rank)))


def head_layout_error(num_q_heads: int, num_kv_heads: int, degree: int) -> Optional[str]:
    """Why no head plan fits, or ``None``."""
    if num_q_heads < 1 or num_kv_heads < 1:
        return f"head counts must be >= 1 (query heads={num_q_heads}, kv heads={num_kv_heads})"
    if num_q_heads % num_kv_heads:
        return (f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) "
                "for grouped-query attention")
    if num_q_heads < degree:
        return (f"ulysses degree {degree} is larger than the {num_q_heads} query heads on this tensor-parallel "
                f"rank: every rank needs at least one head; use a degree <= {num_q_heads} "
                "(ring context parallelism covers larger degrees)")
    return None


def is_even(num_q_heads: int, num_kv_heads: int, degree: int) -> bool:
    return head_layout_error(num_q_heads, num_kv_heads, degree) is None and \
        HeadPlan(num_q_heads, num_kv_heads, degree).regular


def overlap_error(num_q_heads: int, num_kv_heads: int, degree: int, chunks) -> Optional[str]:
    """Why ``chunks`` head chunks cannot be pipelined (:mod:`ulysses_mcore.overlap`), or ``None``."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"overlap_chunks must be an integer >= 1, got {chunks!r}"
    if chunks == 1:
        return None
    plan = HeadPlan(num_q_heads, num_kv_heads, degree)
    q, kv = num_q_heads // degree, max(num_kv_heads // degree, 1)
    if q % chunks or plan.kv_replicas > 1 or kv % chunks:
        return (f"overlap_chunks={chunks} must divide the {q} query and {kv} kv heads each rank computes "
                f"(kv heads replicated x{plan.kv_replicas}); use overlap_chunks=1")
    return None


# ----------------------------------------------------------------------------- buffers
def _unreferenced(buf: torch.Tensor) -> bool:
    """True when nothing but the pool holds ``buf``'s storage (the temporary storage object
    made here accounts for the second reference)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2


class _BufferPool(threading.local):
    """A free list of CPU buffers for the exchange, per thread.

    On the CPU every fresh multi-MB tensor costs a page fault per 4 KB on first touch
    (measured: 20 ms for 25 MB -- as long as the all-to-all itself), and glibc returns large
    blocks to the OS on free, so each call would pay it again.  A buffer is handed out only
    when nothing else references its storage any more, else a new one is allocated and kept
    (up to ``per_size`` per size).  CUDA tensors bypass it (the caching allocator does this).
    ``ULYSSES_MCORE_POOL=0`` turns it off; :meth:`clear` returns the memory."""

    per_size = 64

    def __init__(self):
        self.free_lists: dict = {}
        self.enabled = os.environ.get("ULYSSES_MCORE_POOL", "1") != "0" and hasattr(torch._C, "_storage_Use_Count")

    def take(self, shape, dtype, device) -> torch.Tensor:
        device = torch.device(device)
        if not self.enabled or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        n = 1
        for x in shape:
            n *= x
        bufs = self.free_lists.setdefault((n, dtype), [])
        for buf in bufs:
            if _unreferenced(buf):
                return buf.view(shape)
        buf = torch.empty(n, dtype=dtype, device=device)
        if len(bufs) < self.per_size:
            bufs.append(buf)
        return buf.view(shape)

    def clear(self):
        self.free_lists.clear()


POOL = _BufferPool()


def _fresh(view: torch.Tensor, shape) -> torch.Tensor:
    out = POOL.take(tuple(view.shape), view.dtype, view.device)
    out.copy_(view)
    return out.view(shape)


# ----------------------------------------------------------------------------- the collective
def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None, async_op=False):
    """The one all-to-all of the package (split sizes in elements of flat buffers, or None)."""
    if out_splits is not None:
        out, inp = out.view(-1), inp.reshape(-1)
    return dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=async_op)


def _recv_as_layout(recv: torch.Tensor, layout: str) -> torch.Tensor:
    """``[P, A, B, ...]`` received by source rank -> the full-sequence tensor in ``layout``."""
    P, A, B, *rest = recv.shape
    if seq_dim(layout) == 0:
        return recv.view(P * A, B, *rest)  # source-major == token order: a view
    return recv.transpose(0, 1).reshape(A, P * B, *rest)  # a copy unless b == 1


def _layout_as_chunks(x: torch.Tensor, layout: str, P: int) -> torch.Tensor:
    """Full-sequence ``layout`` tensor -> ``[P, A, B, n, d]`` by token block (contiguous sbhd:
    a view; else one copy into a pooled buffer)."""
    if seq_dim(layout) == 0:
        if x.is_contiguous():
            return x.view(P, x.shape[0] // P, *x.shape[1:])
        chunks = x.unflatten(0, (P, x.shape[0] // P))
    else:
        chunks = x.unflatten(1, (P, x.shape[1] // P)).transpose(0, 1)
    return _fresh(chunks, tuple(chunks.shape))


def _chunks_of_full(g: torch.Tensor, layout: str, P: int) -> torch.Tensor:
    """A (strided) ``[P, A, B, n, d]`` view of a full-sequence tensor by token block."""
    sd = seq_dim(layout)
    ch = g.unflatten(sd, (P, g.shape[sd] // P))
    return ch if sd == 0 else ch.transpose(0, 1)


def _splits(plan: HeadPlan, heads_of, A, B, d) -> List[int]:
    """Elements per destination rank of a flat buffer holding ``heads_of(j)`` heads for rank j."""
    return [A * B * heads_of(j) * d for j in range(plan.degree)]


# A q/k/v block for one rank is, per (token, batch) row, its nq query heads (head dim dq), then its
# nk key heads (dq), then its nk value heads (dv; dv != dq for multi-latent attention): W elements.
def _widths(nq: int, nk: int, dq: int, dv: int):
    """``[(start, heads, head dim)]`` of the q, k and v parts of a row, and the row width W."""
    parts = [(0, nq, dq), (nq * dq, nk, dq), (nq * dq + nk * dq, nk, dv)]
    return parts, nq * dq + nk * (dq + dv)


def _part(buf: torch.Tensor, start: int, heads: int, d: int) -> torch.Tensor:
    """A ``[..., heads, d]`` view of columns ``start .. start + heads*d`` of a ``[..., W]`` buffer."""
    return buf[..., start:start + heads * d].unflatten(-1, (heads, d))


def _width_of_rank(plan: HeadPlan, j: int, dq: int, dv: int) -> int:
    return _widths(plan.q_count(j), plan.kv_count(j), dq, dv)[1]


def _dest_blocks(buf: torch.Tensor, plan: HeadPlan, A, B, dq, dv):
    """The per-destination blocks of a flat q/k/v buffer in rank order: for each rank j,
    (its q, k, v parts ``[A, B, n, d]``, its query-head range, its kv-head range)."""
    flat, off = buf.view(-1), 0
    for j in range(plan.degree):
        parts, W = _widths(plan.q_count(j), plan.kv_count(j), dq, dv)
        blk = flat[off:off + A * B * W].view(A, B, W)
        yield [_part(blk, *p) for p in parts], plan.q_range(j), plan.kv_range(j)
        off += A * B * W


def _pack_qkv(q, k, v, plan: HeadPlan) -> Tuple[torch.Tensor, Optional[List[int]]]:
    """One pass into the send buffer: block j = rank j's q heads, then its k, v heads.
    Returns the buffer and the per-destination split sizes (None when uniform)."""
    P = plan.degree
    A, B, _, dq = q.shape
    dv = v.shape[3]
    if plan.regular:
        qn, kn = plan.q_count(0), plan.kv_count(0)
        (pq, pk, pv), W = _widths(qn, kn, dq, dv)
        send = POOL.take((P, A, B, W), q.dtype, q.device)
        _part(send, *pq).copy_(q.unflatten(2, (P, qn)).permute(2, 0, 1, 3, 4))
        for (start, _, d), t in ((pk, k), (pv, v)):
            if plan.kv_replicas == 1:
                _part(send, start, kn, d).copy_(t.unflatten(2, (P, kn)).permute(2, 0, 1, 3, 4))
            else:  # each kv head goes to kv_replicas consecutive ranks
                hk, rep = plan.num_kv_heads, plan.kv_replicas
                dst = send.view(hk, rep, A, B, W)[..., start:start + d]
                dst.copy_(t.permute(2, 0, 1, 3)[:, None].expand_as(dst))
        return send, None
    sizes = [A * B * _width_of_rank(plan, j, dq, dv) for j in range(P)]
    send = POOL.take((sum(sizes),), q.dtype, q.device)
    for (bq, bk, bv), (qlo, qhi), (klo, khi) in _dest_blocks(send, plan, A, B, dq, dv):
        bq.copy_(q[:, :, qlo:qhi])
        bk.copy_(k[:, :, klo:khi])
        bv.copy_(v[:, :, klo:khi])
    return send, (None if plan.uniform else sizes)


def _unpack_qkv_grad(recv: torch.Tensor, plan: HeadPlan, A, B, dq, dv, kshape, vshape):
    """Inverse of :func:`_pack_qkv` for gradients: copies of a kv head are summed."""
    P = plan.degree
    if plan.regular:
        qn, kn = plan.q_count(0), plan.kv_count(0)
        (pq, pk, pv), W = _widths(qn, kn, dq, dv)
        buf = recv.view(P, A, B, W)
        out = [_fresh(_part(buf, *pq).permute(1, 2, 0, 3, 4), (A, B, P * qn, dq))]
        for start, _, d in (pk, pv):
            if plan.kv_replicas == 1:
                out.append(_fresh(_part(buf, start, kn, d).permute(1, 2, 0, 3, 4), (A, B, P * kn, d)))
            else:
                summed = buf[..., start:start + d].reshape(plan.num_kv_heads, plan.kv_replicas, A, B, d).sum(1)
                out.append(summed.permute(1, 2, 0, 3).contiguous())
        return tuple(out)
    gq = recv.new_empty(A, B, plan.num_q_heads, dq)
    gk, gv = recv.new_zeros(kshape), recv.new_zeros(vshape)
    for (bq, bk, bv), (qlo, qhi), (klo, khi) in _dest_blocks(recv, plan, A, B, dq, dv):
        gq[:, :, qlo:qhi] = bq
        gk[:, :, klo:khi] += bk
        gv[:, :, klo:khi] += bv
    return gq, gk, gv


# ----------------------------------------------------------------------------- autograd pair
class SeqToHead(torch.autograd.Function):
    """q, k, v token shards -> full-sequence q, k, v of this rank's heads, in one collective."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan: HeadPlan, layout: str, rank: int):
        P = plan.degree
        A, B, _, dq = q.shape
        dv = v.shape[3]
        ctx.group, ctx.plan, ctx.layout, ctx.rank = group, plan, layout, rank
        ctx.kshape, ctx.vshape, ctx.dims = k.shape, v.shape, (dq, dv)
        # 1. one copy: q, k, v -> one send buffer, block j holding rank j's heads
        send, sizes = _pack_qkv(q, k, v, plan)
        parts, W = _widths(plan.q_count(rank), plan.kv_count(rank), dq, dv)
        recv = POOL.take((P, A, B, W), q.dtype, q.device)
        # 2. one collective
        all_to_all(recv, send, group, None if sizes is None else [A * B * W] * P, sizes)
        ctx.sizes = sizes
        # 3. the received buffer is the full sequence (sbhd: a view; bshd: one copy if b > 1)
        full = _recv_as_layout(recv, layout)
        return tuple(_part(full, *p) for p in parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, gq, gk, gv):
        plan, layout, rank, P = ctx.plan, ctx.layout, ctx.rank, ctx.plan.degree
        dq, dv = ctx.dims
        ref = next(g for g in (gq, gk, gv) if g is not None)
        parts, W = _widths(plan.q_count(rank), plan.kv_count(rank), dq, dv)
        sd = seq_dim(layout)
        A, B = ref.shape[0], ref.shape[1]
        if sd == 0:
            A //= P
        else:
            B //= P
        buf = POOL.take((P, A, B, W), ref.dtype, ref.device)
        # 1. one copy: the three gradients into the layout the forward received
        for g, p in zip((gq, gk, gv), parts):
            if g is None:
                _part(buf, *p).zero_()
            else:
                _part(buf, *p).copy_(_chunks_of_full(g, layout, P))
        # 2. one collective (the inverse permutation of the forward's)
        sizes = ctx.sizes
        recv = POOL.take((sum(sizes),) if sizes else (P, A, B, W), ref.dtype, ref.device)
        all_to_all(recv, buf, ctx.group, sizes, None if sizes is None else [A * B * W] * P)
        # 3. one copy back to [A, B, h, d]; copies of a kv head summed
        gq, gk, gv = _unpack_qkv_grad(recv, plan, A, B, dq, dv, ctx.kshape, ctx.vshape)
        return gq, gk, gv, None, None, None, None


class HeadToSeq(torch.autograd.Function):
    """Full-sequence output of this rank's heads -> token shard with every head, one collective."""

    @staticmethod
    def forward(ctx, out, group, plan: HeadPlan, layout: str, rank: int):
        P = plan.degree
        ctx.group, ctx.plan, ctx.layout, ctx.rank = group, plan, layout, rank
        send = _layout_as_chunks(out, layout, P)  # [P, A, B, n_me, d]: zero copies for contiguous sbhd
        _, A, B, n_me, d = send.shape
        if plan.uniform:
            recv = POOL.take(tuple(send.shape), send.dtype, send.device)
            all_to_all(recv, send, group)
            return _fresh(recv.permute(1, 2, 0, 3, 4), (A, B, P * n_me, d))
        sizes = _splits(plan, plan.q_count, A, B, d)
        recv = POOL.take((sum(sizes),), send.dtype, send.device)
        all_to_all(recv, send, group, sizes, [A * B * n_me * d] * P)
        result = send.new_empty(A, B, plan.num_q_heads, d)
        off = 0
        for j in range(P):
            lo, hi = plan.q_range(j)
            result[:, :, lo:hi] = recv[off:off + sizes[j]].view(A, B, hi - lo, d)
            off += sizes[j]
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        plan, P, rank = ctx.plan, ctx.plan.degree, ctx.rank
        A, B, _, d = g.shape
        n_me = plan.q_count(rank)
        if plan.uniform:
            send = _fresh(g.unflatten(2, (P, n_me)).permute(2, 0, 1, 3, 4), (P, A, B, n_me, d))
            recv = POOL.take(tuple(send.shape), g.dtype, g.device)
            all_to_all(recv, send, ctx.group)
        else:
            sizes = _splits(plan, plan.q_count, A, B, d)
            send = torch.cat([g[:, :, slice(*plan.q_range(j))].reshape(-1) for j in range(P)])
            recv = POOL.take((P, A, B, n_me, d), g.dtype, g.device)
            all_to_all(recv, send, ctx.group, [A * B * n_me * d] * P, sizes)
        return _recv_as_layout(recv, ctx.layout), None, None, None, None


def seq_to_head(q, k, v, group, plan: HeadPlan, layout: str = "sbhd", rank: Optional[int] = None):
    """Differentiable: token-sharded q, k, v -> this rank's heads over the full sequence."""
    if plan.degree == 1:
        return q, k, v
    return SeqToHead.apply(q, k, v, group, plan, layout, dist.get_rank(group) if rank is None else rank)


def head_to_seq(out, group, plan: HeadPlan, layout: str = "sbhd", rank: Optional[int] = None):
    """Differentiable: this rank's heads over the full sequence -> token shard, all heads."""
    if plan.degree == 1:
        return out
    return HeadToSeq.apply(out, group, plan, layout, dist.get_rank(group) if rank is None else rank)


def expand_kv(t: torch.Tensor, plan: HeadPlan, rank: int) -> torch.Tensor:
    """One kv head per local query head, when the local heads are not an ordinary GQA layout."""
    idx = plan.kv_index_for_q(rank)
    return t if idx is None else t.index_select(2, torch.tensor(idx, device=t.device))


class _PackLse(torch.autograd.Function):
    """``out [..., dv]`` and ``lse [...]`` -> ``[..., dv + m]`` in out's dtype, the lse bit-cast into
    ``m`` columns (2 for a float32 lse beside bf16/fp16, else 1): the all-to-all only moves bits."""

    @staticmethod
    def forward(ctx, out, lse):
        ctx.dv, ctx.lse_dtype = out.shape[-1], lse.dtype
        return torch.cat([out, lse.contiguous().unsqueeze(-1).view(out.dtype)], dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., :ctx.dv], g[..., ctx.dv:].contiguous().view(ctx.lse_dtype).squeeze(-1)


class _UnpackLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed, dv, lse_dtype):
        ctx.dtype, ctx.dv, ctx.lse_dtype = packed.dtype, dv, lse_dtype
        ctx.set_materialize_grads(False)
        return packed[..., :dv], packed[..., dv:].contiguous().view(lse_dtype).squeeze(-1)

    @staticmethod
    def backward(ctx, gout, glse):
        if gout is None and glse is None:
            return None, None, None
        if gout is None:
            gout = torch.zeros((*glse.shape, ctx.dv), dtype=ctx.dtype, device=glse.device)
        if glse is None:
            glse = torch.zeros(gout.shape[:-1], dtype=ctx.lse_dtype, device=gout.device)
        return torch.cat([gout, glse.contiguous().unsqueeze(-1).view(ctx.dtype)], dim=-1), None, None


def pack_lse(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return _PackLse.apply(out, lse)


def unpack_lse(packed: torch.Tensor, dv: int, lse_dtype: torch.dtype):
    """Inverse of :func:`pack_lse`: ``(out [..., dv], lse [...])``, both differentiable."""
    return _UnpackLse.apply(packed, dv, lse_dtype)


# ----------------------------------------------------------------------------- references
def reference_seq_to_head(full: torch.Tensor, rank: int, plan: HeadPlan, kind: str, layout: str = "sbhd"):
    """Heads of ``rank`` from the full-sequence tensor (``kind`` 'q' or 'kv'): what the exchange delivers."""
    lo, hi = plan.q_range(rank) if kind == "q" else plan.kv_range(rank)
    return full[:, :, lo:hi]


def shard_tokens(full: torch.Tensor, rank: int, degree: int, layout: str = "sbhd") -> torch.Tensor:
    """Contiguous token shard ``rank`` of ``degree`` of a full-sequence tensor."""
    return full.chunk(degree, dim=seq_dim(layout))[rank]
