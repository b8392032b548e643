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

Everything that depends only on the call's shape -- buffer shapes, split sizes, where each
part sits -- is worked out once into a :class:`QkvRoute` / :class:`OutRoute`, which the
prepared call (:mod:`ulysses_mcore.attention`) keeps: a steady-state call does the copies and
the collective, no bookkeeping.  The routes' ``start`` / ``finish`` steps are also what
:mod:`ulysses_mcore.overlap` pipelines, per head chunk, asynchronously.  Layout logic lives in
:func:`seq_dim` and the two ``_recv_as_layout`` / ``_by_block`` helpers only.  The
single-rank references the exchange is tested against live in ``tests/helpers.py``.
"""

from __future__ import annotations

import math
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
    """Which heads go to which rank, for ``num_q_heads`` / ``num_kv_heads`` over ``ulysses`` ranks."""

    num_q_heads: int
    num_kv_heads: int
    ulysses: int

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def q_range(self, rank: int) -> Tuple[int, int]:
        base, extra = divmod(self.num_q_heads, self.ulysses)
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
        hq, hk, ulysses = self.num_q_heads, self.num_kv_heads, self.ulysses
        return hq % ulysses == 0 and (hk % ulysses == 0 or ulysses % hk == 0)

    @cached_property
    def uniform(self) -> bool:
        """All split sizes equal: the all-to-all needs no split sizes."""
        return len({(self.q_count(j), self.kv_count(j)) for j in range(self.ulysses)}) == 1

    @property
    def kv_replicas(self) -> int:
        """Regular plans: how many consecutive ranks receive the same kv head (1 = scatter)."""
        return self.ulysses // self.num_kv_heads if self.num_kv_heads < self.ulysses else 1

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


def head_layout_error(num_q_heads: int, num_kv_heads: int, ulysses: int) -> Optional[str]:
    """Why no head plan fits, or ``None``."""
    if num_q_heads < 1 or num_kv_heads < 1:
        return f"head counts must be >= 1 (query heads={num_q_heads}, kv heads={num_kv_heads})"
    if num_q_heads % num_kv_heads:
        return (
            f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) for grouped-query attention"
        )
    if num_q_heads < ulysses:
        return (
            f"ulysses degree {ulysses} is larger than the {num_q_heads} query heads on this tensor-parallel "
            f"rank: every rank needs at least one head; use a degree <= {num_q_heads} "
            "(ring context parallelism covers larger degrees)"
        )
    return None


def is_even(num_q_heads: int, num_kv_heads: int, ulysses: int) -> bool:
    return (
        head_layout_error(num_q_heads, num_kv_heads, ulysses) is None
        and HeadPlan(num_q_heads, num_kv_heads, ulysses).regular
    )


def overlap_error(num_q_heads: int, num_kv_heads: int, ulysses: int, chunks) -> Optional[str]:
    """Why ``chunks`` head chunks cannot be pipelined (:mod:`ulysses_mcore.overlap`), or ``None``."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"overlap_chunks must be an integer >= 1, got {chunks!r}"
    if chunks == 1:
        return None
    plan = HeadPlan(num_q_heads, num_kv_heads, ulysses)
    q, kv = num_q_heads // ulysses, max(num_kv_heads // ulysses, 1)
    if q % chunks or plan.kv_replicas > 1 or kv % chunks:
        return (
            f"overlap_chunks={chunks} must divide the {q} query and {kv} kv heads each rank computes "
            f"(kv heads replicated x{plan.kv_replicas}); use overlap_chunks=1"
        )
    return None


# ----------------------------------------------------------------------------- buffers
def _unreferenced(buf: torch.Tensor) -> bool:
    """True when nothing but the pool holds ``buf``'s storage (the temporary storage object
    made here accounts for the second reference)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2


def size_class(n: int) -> int:
    """``n`` elements rounded up to a power of two: shapes within a factor of two share buffers (a
    buffer's pages past what a call writes are never touched, so they cost address space, not memory)."""
    return 1 << max(0, (n - 1).bit_length())


class BufferPool(threading.local):
    """A free list of CPU buffers for the exchange, per thread, by size class, bounded in bytes.

    On the CPU every fresh multi-MB tensor costs a page fault per 4 KB on first touch
    (measured: 20 ms for 25 MB -- as long as the all-to-all itself), and glibc returns large
    blocks to the OS on free, so each call would pay it again.  Buffers are flat, of a size class
    (:func:`size_class`), handed out as a view of the shape asked for when nothing else references
    their storage any more, else a new one is allocated and kept (up to ``per_size`` per class) while
    the pool holds at most ``max_bytes`` -- past that the classes used longest ago are dropped first.
    Shapes that change from call to call (``--dynamic-ulysses``) share a few classes, so memory stays
    flat.  CUDA tensors bypass it (the caching allocator does this), and so do buffers under
    ``min_bytes``.  ``enabled = False`` turns it off; :meth:`clear` returns the memory."""

    per_size = 64
    min_bytes = 1 << 17  # below glibc's mmap threshold (128 KB) malloc reuses its heap: nothing to save
    max_bytes = 1 << 30

    def __init__(self):
        self.free_lists: dict = {}  # (elements, dtype) -> flat buffers, the class used last at the end
        self.held = 0
        self.enabled = hasattr(torch._C, "_storage_Use_Count")

    def take(self, shape: tuple, dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        if not self.enabled or device.type != "cpu" or n * dtype.itemsize < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (size_class(n), dtype)
        bufs = self.free_lists.pop(key, [])
        self.free_lists[key] = bufs  # now the most recently used class
        for buf in bufs:
            if _unreferenced(buf):
                return buf[:n].view(shape)
        nbytes = key[0] * dtype.itemsize
        self._release_idle(nbytes, key)  # idle buffers of other classes make room for this one first
        buf = torch.empty(key[0], dtype=dtype, device=device)
        if len(bufs) < self.per_size and self._room(nbytes, key):
            bufs.append(buf)
            self.held += nbytes
        return buf[:n].view(shape)

    def _release_idle(self, nbytes: int, key) -> None:
        """Free up to ``nbytes`` of buffers nothing uses in the classes used longest ago (not ``key``):
        a run whose shapes change keeps about one working set, not one per class."""
        for old in list(self.free_lists):
            if nbytes <= 0 or old == key:
                return
            keep = []
            for buf in self.free_lists[old]:
                if nbytes > 0 and _unreferenced(buf):
                    size = buf.numel() * buf.element_size()
                    self.held, nbytes = self.held - size, nbytes - size
                else:
                    keep.append(buf)
            self.free_lists[old] = keep

    def _room(self, nbytes: int, key) -> bool:
        """Drop the classes used longest ago (not ``key``) until ``nbytes`` more fit under ``max_bytes``."""
        for old in list(self.free_lists):
            if self.held + nbytes <= self.max_bytes or old == key:
                break
            for buf in self.free_lists.pop(old):
                self.held -= buf.numel() * buf.element_size()
        return self.held + nbytes <= self.max_bytes

    def clear(self):
        self.free_lists.clear()
        self.held = 0


POOL = BufferPool()


# ----------------------------------------------------------------------------- the collective
def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None, async_op=False):
    """The one all-to-all of the package (split sizes in elements of flat buffers, or None)."""
    if out_splits is not None:
        out, inp = out.view(-1), inp.reshape(-1)
    return dist.all_to_all_single(
        out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group, async_op=async_op
    )


def _recv_as_layout(recv: torch.Tensor, layout: str) -> torch.Tensor:
    """``[P, A, B, ...]`` received by source rank -> the full-sequence tensor in ``layout``."""
    ulysses, A, B, *rest = recv.shape
    if seq_dim(layout) == 0:
        return recv.view(ulysses * A, B, *rest)  # source-major == token order: a view
    return recv.transpose(0, 1).reshape(A, ulysses * B, *rest)  # a copy unless b == 1


def _by_block(t: torch.Tensor, sd: int, ulysses: int, A: int, B: int) -> torch.Tensor:
    """A full-sequence tensor (``[P*A, B, ...]`` for sbhd, ``[A, P*B, ...]`` for bshd: ``sd`` its
    sequence dim) as ``[P, A, B, ...]`` by token block: a view, strided for bshd."""
    if sd == 0:
        return t.view(ulysses, A, B, *t.shape[2:])
    return t.view(A, ulysses, B, *t.shape[2:]).transpose(0, 1)


# A q/k/v block for one rank is, per (token, batch) row, its nq query heads (head dim dq), then its
# nk key heads (dq), then its nk value heads (dv; dv != dq for multi-latent attention): W elements.
def _widths(nq: int, nk: int, dq: int, dv: int):
    """``[(start, heads, head dim)]`` of the q, k and v parts of a row, and the row width W."""
    parts = [(0, nq, dq), (nq * dq, nk, dq), (nq * dq + nk * dq, nk, dv)]
    return parts, nq * dq + nk * (dq + dv)


def _part(buf: torch.Tensor, start: int, heads: int, d: int) -> torch.Tensor:
    """A ``[..., heads, d]`` view of columns ``start .. start + heads*d`` of a ``[..., W]`` buffer."""
    return buf[..., start : start + heads * d].unflatten(-1, (heads, d))


# ----------------------------------------------------------------------------- routes
class QkvRoute:
    """The q/k/v exchange of one call shape, worked out once (cached with the prepared call):
    buffer shapes, split sizes, and each part's place as precomputed strided views, so a call
    makes views with one C call each and copies.  ``A, B``: the two dims before the heads of a
    token shard (``sbhd``: ``s/P, b``; ``bshd``: ``b, s/P``).

    Regular plans pack with one strided copy per tensor from 5-D per-destination views
    ``[A, B, P, n, d]`` (which is also how a head chunk of :mod:`ulysses_mcore.overlap` is
    given); other plans walk the destinations (uneven heads, kv groups straddling ranks)."""

    def __init__(self, plan: HeadPlan, rank: int, A: int, B: int, dq: int, dv: int, layout: str):
        ulysses = plan.ulysses
        self.plan, self.layout, self.sd, self.ulysses, self.A, self.B, self.dq, self.dv = (
            plan,
            layout,
            seq_dim(layout),
            ulysses,
            A,
            B,
            dq,
            dv,
        )
        self.mine, W = _widths(plan.q_count(rank), plan.kv_count(rank), dq, dv)
        self.recv_shape = (ulysses, A, B, W)
        full = (ulysses * A, B) if self.sd == 0 else (A, ulysses * B)
        self.full_shape = (*full, W)
        # this rank's q, k, v in a contiguous [S-ish, B-ish, W] buffer: (size, stride, offset)
        self.mine_views = [((*full, n, d), (full[1] * W, W, d, 1), start) for start, n, d in self.mine]
        if plan.regular:
            self._regular(ulysses, A, B, dq, dv)
            return
        self.blocks, off = [], 0  # per destination: (offset, row width, its q range, its kv range)
        for j in range(ulysses):
            Wj = _widths(plan.q_count(j), plan.kv_count(j), dq, dv)[1]
            self.blocks.append((off, Wj, plan.q_range(j), plan.kv_range(j)))
            off += A * B * Wj
        self.send_shape = (off,)
        even = plan.uniform
        self.send_splits = None if even else [A * B * w for _, w, _, _ in self.blocks]
        self.recv_splits = None if even else [A * B * W] * ulysses

    def _regular(self, ulysses, A, B, dq, dv):
        plan = self.plan
        nq, nk = plan.q_count(0), plan.kv_count(0)
        self.send_parts, Ws = _widths(nq, nk, dq, dv)
        self.send_shape, self.send_splits, self.recv_splits = (ulysses, A, B, Ws), None, None
        self.dest_shapes = [(A, B, ulysses, n, d) for _, n, d in self.send_parts]
        # each part of the send buffer [P, A, B, Ws] seen as [A, B, P, n, d]: where q.view(A, B, P, n, d) goes
        self.dest_views = [
            ((A, B, ulysses, n, d), (B * Ws, Ws, A * B * Ws, d, 1), start) for start, n, d in self.send_parts
        ]
        self.replicas = plan.kv_replicas

    # -- forward: pack, exchange, the received parts
    def pack_all(self, q, k, v) -> torch.Tensor:
        """q, k, v token shards -> the send buffer (one copy of each)."""
        send = POOL.take(self.send_shape, q.dtype, q.device)
        if not self.plan.regular:
            return self.pack_uneven(q, k, v, send)
        if self.replicas > 1:
            return self.pack(q.view(self.dest_shapes[0]), k.unsqueeze(3), v.unsqueeze(3), send)
        return self.pack(*(t.view(shape) for t, shape in zip((q, k, v), self.dest_shapes)), send)

    def pack(self, q5, k5, v5, send: torch.Tensor) -> torch.Tensor:
        """Regular plans: ``[A, B, P, n, d]`` views in (a replicated kv head: ``[A, B, hk, 1, d]``);
        one copy each into ``send [P, A, B, Ws]``."""
        views = self.dest_views
        send.as_strided(*views[0]).copy_(q5)
        if self.replicas == 1:
            send.as_strided(*views[1]).copy_(k5)
            send.as_strided(*views[2]).copy_(v5)
            return send
        hk, rep = self.plan.num_kv_heads, self.replicas  # each kv head goes to `rep` consecutive ranks
        rows = send.view(hk, rep, *send.shape[1:])
        for (start, _, d), t5 in zip(self.send_parts[1:], (k5, v5)):
            dst = rows[..., start : start + d]
            dst.copy_(t5.flatten(2, 3).permute(2, 0, 1, 3)[:, None].expand_as(dst))
        return send

    def pack_uneven(self, q, k, v, send: torch.Tensor) -> torch.Tensor:
        for (bq, bk, bv), (qlo, qhi), (klo, khi) in self._dest(send):
            bq.copy_(q[:, :, qlo:qhi])
            bk.copy_(k[:, :, klo:khi])
            bv.copy_(v[:, :, klo:khi])
        return send

    def _dest(self, buf: torch.Tensor):
        """Per destination: its q, k, v parts ``[A, B, n, d]`` of a flat buffer, its q and kv ranges."""
        dq, dv, A, B = self.dq, self.dv, self.A, self.B
        for off, Wj, (qlo, qhi), (klo, khi) in self.blocks:
            blk = buf[off : off + A * B * Wj].view(A, B, Wj)
            parts = _widths(qhi - qlo, khi - klo, dq, dv)[0]
            yield [_part(blk, *p) for p in parts], (qlo, qhi), (klo, khi)

    def start(self, send: torch.Tensor, group, async_op=False):
        """(receive buffer, work handle or None, send buffer: keep it until the work is done)."""
        recv = POOL.take(self.recv_shape, send.dtype, send.device)
        return recv, all_to_all(recv, send, group, self.recv_splits, self.send_splits, async_op), send

    def received(self, recv: torch.Tensor):
        """The received buffer as this rank's q, k, v over the full sequence (sbhd: views)."""
        full = recv.view(self.full_shape) if self.sd == 0 else _recv_as_layout(recv, self.layout)
        if full.is_contiguous() and full.storage_offset() == 0:
            return tuple(full.as_strided(*view) for view in self.mine_views)
        return tuple(_part(full, *p) for p in self.mine)

    # -- backward: the three gradients back to the token shards
    def start_grad(self, gq, gk, gv, group, async_op=False):
        """Gradients of :meth:`received`'s parts -> their senders (one all-to-all)."""
        ref = gq if gq is not None else (gk if gk is not None else gv)
        buf = POOL.take(self.recv_shape, ref.dtype, ref.device)
        for g, p, view in zip((gq, gk, gv), self.mine, self.mine_views):
            # sbhd: the buffer is the full sequence, each part a precomputed view; bshd: by token block
            dst = buf.as_strided(*view) if self.sd == 0 else _part(buf, *p)
            if g is None:
                dst.zero_()
            else:
                dst.copy_(g if self.sd == 0 else _by_block(g, self.sd, self.ulysses, self.A, self.B))
        recv = POOL.take(self.send_shape, ref.dtype, ref.device)
        return recv, all_to_all(recv, buf, group, self.send_splits, self.recv_splits, async_op), buf

    def unpack_grad(self, recv: torch.Tensor, gq5, gk5, gv5) -> None:
        """Regular plans: the received gradient buffer into ``[A, B, P, n, d]`` views (a replicated kv
        head: ``[A, B, hk, 1, d]``); copies of a replicated kv head are summed."""
        views = self.dest_views
        gq5.copy_(recv.as_strided(*views[0]))
        if self.replicas == 1:
            gk5.copy_(recv.as_strided(*views[1]))
            gv5.copy_(recv.as_strided(*views[2]))
            return
        plan = self.plan
        for (start, _, d), g5 in zip(self.send_parts[1:], (gk5, gv5)):
            summed = recv[..., start : start + d].unflatten(0, (plan.num_kv_heads, self.replicas)).sum(1)
            g5.copy_(summed.permute(1, 2, 0, 3).unsqueeze(3))

    def unpack_grad_all(self, recv: torch.Tensor, kshape, vshape):
        """The received gradient buffer -> gradients of the token shards q, k, v."""
        if not self.plan.regular:
            return self.unpack_grad_uneven(recv, kshape, vshape)
        gq = POOL.take((self.A, self.B, self.plan.num_q_heads, self.dq), recv.dtype, recv.device)
        gk, gv = (POOL.take(tuple(shape), recv.dtype, recv.device) for shape in (kshape, vshape))
        if self.replicas > 1:
            self.unpack_grad(recv, gq.view(self.dest_shapes[0]), gk.unsqueeze(3), gv.unsqueeze(3))
        else:
            self.unpack_grad(recv, *(t.view(shape) for t, shape in zip((gq, gk, gv), self.dest_shapes)))
        return gq, gk, gv

    def unpack_grad_uneven(self, recv: torch.Tensor, kshape, vshape):
        gq = recv.new_empty(self.A, self.B, self.plan.num_q_heads, self.dq)
        gk, gv = recv.new_zeros(kshape), recv.new_zeros(vshape)
        for (bq, bk, bv), (qlo, qhi), (klo, khi) in self._dest(recv):
            gq[:, :, qlo:qhi] = bq
            gk[:, :, klo:khi] += bk
            gv[:, :, klo:khi] += bv
        return gq, gk, gv


class OutRoute:
    """The output exchange of one call shape: this rank's heads ``n_me`` over the full sequence
    -> the token shard with every head.  Uniform plans: one ``[P, A, B, n, d]`` buffer each way."""

    def __init__(self, plan: HeadPlan, rank: int, A: int, B: int, d: int, layout: str):
        ulysses = plan.ulysses
        self.plan, self.layout, self.sd, self.ulysses, self.A, self.B, self.d = (
            plan,
            layout,
            seq_dim(layout),
            ulysses,
            A,
            B,
            d,
        )
        self.n_me = plan.q_count(rank)
        self.buf_shape = (ulysses, A, B, self.n_me, d)
        self.result5 = (A, B, ulysses, self.n_me, d)
        self.result = (A, B, ulysses * self.n_me, d)
        self.full = ((ulysses * A, B) if self.sd == 0 else (A, ulysses * B)) + (self.n_me, d)
        if plan.uniform:
            self.sizes = self.mine = None
            return
        self.sizes = [A * B * plan.q_count(j) * d for j in range(ulysses)]
        self.mine = [A * B * self.n_me * d] * ulysses
        self.offsets = [sum(self.sizes[:j]) for j in range(ulysses)]
        self.ranges = [plan.q_range(j) for j in range(ulysses)]

    def start(self, out: torch.Tensor, group, async_op=False):
        """``out [S, B, n_me, d]`` in ``layout`` -> (receive buffer, work handle or None, send buffer)."""
        send = _by_block(out, self.sd, self.ulysses, self.A, self.B)
        if not send.is_contiguous():
            send = POOL.take(self.buf_shape, out.dtype, out.device).copy_(send)
        recv = POOL.take(self.buf_shape if self.sizes is None else (sum(self.sizes),), out.dtype, out.device)
        return recv, all_to_all(recv, send, group, self.sizes, self.mine, async_op), send

    def finish(self, recv: torch.Tensor, result5=None) -> torch.Tensor:
        """The received blocks as the token shard ``[A, B, h, d]``, or copied into a chunk's
        ``result5 [A, B, P, n, d]`` view (returned as given)."""
        if self.sizes is None:
            if result5 is not None:
                return result5.copy_(recv.permute(1, 2, 0, 3, 4))
            result5 = POOL.take(self.result5, recv.dtype, recv.device)
            return result5.copy_(recv.permute(1, 2, 0, 3, 4)).view(self.result)
        A, B, d = self.A, self.B, self.d
        result = recv.new_empty(A, B, self.plan.num_q_heads, d)
        for (lo, hi), off, n in zip(self.ranges, self.offsets, self.sizes):
            result[:, :, lo:hi] = recv[off : off + n].view(A, B, hi - lo, d)
        return result

    def start_grad(self, g: torch.Tensor, group, async_op=False, g5=None):
        """Gradient of the token shard ``[A, B, h, d]`` (or a chunk's ``[A, B, P, n, d]`` view) -> back."""
        if self.sizes is None:
            g5 = g.view(self.result5) if g5 is None else g5
            send = POOL.take(self.buf_shape, g5.dtype, g5.device).copy_(g5.permute(2, 0, 1, 3, 4))
        else:
            send = torch.cat([g[:, :, lo:hi].reshape(-1) for lo, hi in self.ranges])
        recv = POOL.take(self.buf_shape, send.dtype, send.device)
        return recv, all_to_all(recv, send, group, self.mine, self.sizes, async_op), send

    def finish_grad(self, recv: torch.Tensor) -> torch.Tensor:
        if self.sd == 0:
            return recv.view(self.full)
        return _recv_as_layout(recv, self.layout)


def qkv_route(q, v, plan: HeadPlan, rank: int, layout: str) -> QkvRoute:
    return QkvRoute(plan, rank, q.shape[0], q.shape[1], q.shape[3], v.shape[3], layout)


def out_route(out_shard_shape, d: int, plan: HeadPlan, rank: int, layout: str) -> OutRoute:
    """The output route for token shards of ``out_shard_shape`` (``[A, B, ...]``) and head dim ``d``."""
    return OutRoute(plan, rank, out_shard_shape[0], out_shard_shape[1], d, layout)


# ----------------------------------------------------------------------------- autograd pair
class SeqToHead(torch.autograd.Function):
    """q, k, v token shards -> full-sequence q, k, v of this rank's heads, in one collective."""

    @staticmethod
    def forward(ctx, q, k, v, group, route: QkvRoute):
        ctx.group, ctx.route, ctx.kv_shapes = group, route, (k.shape, v.shape)
        send = route.pack_all(q, k, v)  # 1. one copy: block j of the send buffer holds rank j's heads
        recv = route.start(send, group)[0]  # 2. one collective
        return route.received(recv)  # 3. the received buffer is the full sequence (sbhd: views)

    @staticmethod
    @once_differentiable
    def backward(ctx, gq, gk, gv):
        # 1. one copy of the three gradients; 2. one collective (the forward's inverse);
        # 3. one copy back to [A, B, h, d], copies of a replicated kv head summed
        recv = ctx.route.start_grad(gq, gk, gv, ctx.group)[0]
        return (*ctx.route.unpack_grad_all(recv, *ctx.kv_shapes), None, None)


class HeadToSeq(torch.autograd.Function):
    """Full-sequence output of this rank's heads -> token shard with every head, one collective."""

    @staticmethod
    def forward(ctx, out, group, route: OutRoute):
        ctx.group, ctx.route = group, route
        recv = route.start(out, group)[0]
        return route.finish(recv)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        recv = ctx.route.start_grad(g, ctx.group)[0]
        return ctx.route.finish_grad(recv), None, None


def exchange_qkv(q, k, v, group, route: QkvRoute):
    """:class:`SeqToHead` on a prepared route; without autograd's bookkeeping when nothing needs a gradient."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return SeqToHead.apply(q, k, v, group, route)
    return route.received(route.start(route.pack_all(q, k, v), group)[0])


def exchange_out(out, group, route: OutRoute):
    """:class:`HeadToSeq` on a prepared route; without autograd's bookkeeping when nothing needs a gradient."""
    if out.requires_grad:
        return HeadToSeq.apply(out, group, route)
    return route.finish(route.start(out, group)[0])


def seq_to_head(
    q, k, v, group, plan: HeadPlan, layout: str = "sbhd", rank: Optional[int] = None, route: Optional[QkvRoute] = None
):
    """Differentiable: token-sharded q, k, v -> this rank's heads over the full sequence.
    ``route``: a :class:`QkvRoute` worked out before (the prepared call's), else made here."""
    if plan.ulysses == 1:
        return q, k, v
    if route is None:
        route = qkv_route(q, v, plan, dist.get_rank(group) if rank is None else rank, layout)
    return exchange_qkv(q, k, v, group, route)


def head_to_seq(
    out, group, plan: HeadPlan, layout: str = "sbhd", rank: Optional[int] = None, route: Optional[OutRoute] = None
):
    """Differentiable: this rank's heads over the full sequence -> token shard, all heads."""
    if plan.ulysses == 1:
        return out
    if route is None:
        sd = seq_dim(layout)
        shard = list(out.shape[:2])
        shard[sd] //= plan.ulysses
        route = out_route(shard, out.shape[3], plan, dist.get_rank(group) if rank is None else rank, layout)
    return exchange_out(out, group, route)


def kv_index(plan: HeadPlan, rank: int, device) -> Optional[torch.Tensor]:
    """Local kv head of each local query head when the local heads are not an ordinary GQA
    layout (made once per prepared call), else ``None``."""
    idx = plan.kv_index_for_q(rank)
    return None if idx is None else torch.tensor(idx, device=device)


class _PackLse(torch.autograd.Function):
    """``out [..., dv]`` and ``lse [...]`` -> ``[..., dv + m]`` in out's dtype, the lse bit-cast into
    ``m`` columns (2 for a float32 lse beside bf16/fp16, else 1): the all-to-all only moves bits."""

    @staticmethod
    def forward(ctx, out, lse):
        ctx.dv, ctx.lse_dtype = out.shape[-1], lse.dtype
        return torch.cat([out, lse.contiguous().unsqueeze(-1).view(out.dtype)], dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., : ctx.dv], g[..., ctx.dv :].contiguous().view(ctx.lse_dtype).squeeze(-1)


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
