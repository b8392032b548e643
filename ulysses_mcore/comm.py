"""Autograd all-to-alls between the token-sharded and the head-sharded layouts.

A (token, head) cell has an owner.  Outside core attention rank ``r`` of a Ulysses
group of size ``P`` owns tokens ``r*s/P ... (r+1)*s/P - 1`` with every head; inside
it, every token with a band of heads.  Two collectives move ownership:

``SeqToHead``   q, k, v ``[s/P, b, h, d]``  ->  ``[s, b, h/P, d]``   (ONE all_to_all_single)
``HeadToSeq``   out      ``[s, b, h/P, d]``  ->  ``[s/P, b, h, d]``  (ONE all_to_all_single)

Q, K and V cross in one packed buffer: chunk ``j`` of the send buffer holds, for the
local tokens, the query heads of rank ``j`` followed by the KV heads those query heads
use.  Everything is laid out so that the received buffer *is* the attention input:

Layout copies (each "copy" touches every element once), forward / backward:

=============  =================================  ===============================
direction      sbhd                               bshd
=============  =================================  ===============================
SeqToHead      1 (pack) / 1 (unpack grad)         1 pack + 1 unpack if b > 1 / same
HeadToSeq      0-1 pack (0 when the kernel output 1 pack + 1 unpack / same
               is contiguous sbhd) + 1 unpack
=============  =================================  ===============================

In ``sbhd`` the received q/k/v buffer ``[P, s/P, b, n, d]`` is already ``[s, b, n, d]``
(source rank == token block), so the attention kernel reads it with zero copies.

GQA / MQA.  With ``hk`` KV heads and ``hq`` query heads, query heads of one KV group
are contiguous (Megatron's QKV layout), so rank ``j``'s query heads
``j*hq/P ... (j+1)*hq/P - 1`` need KV heads ``(j*hq/P) // g ... ((j+1)*hq/P - 1) // g``
with ``g = hq / hk``.  If ``hk % P == 0`` that is a scatter of ``hk/P`` heads; if
``P % hk == 0`` each rank needs exactly one KV head, shared by ``P/hk`` consecutive
ranks: it is *replicated* into their chunks and the backward sums the replicas.

The single-rank reference of the exchange is :func:`reference_seq_to_head` below (pure
tensor indexing, no collective); ``head_to_seq`` is tested as its exact inverse.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

LAYOUTS = ("sbhd", "bshd")

# Counts every all_to_all_single this module issues; tests read it to prove that
# one forward is exactly two collectives (and one backward two more).
COLLECTIVE_CALLS = {"all_to_all_single": 0}


@dataclass(frozen=True)
class HeadPlan:
    """Which heads go where, for ``num_q_heads`` / ``num_kv_heads`` over ``degree`` ranks."""

    num_q_heads: int
    num_kv_heads: int
    degree: int

    @property
    def q_per_rank(self) -> int:
        return self.num_q_heads // self.degree

    @property
    def kv_per_rank(self) -> int:
        return max(self.num_kv_heads // self.degree, 1)

    @property
    def kv_replicas(self) -> int:
        """How many consecutive ranks receive the same KV head (1 = plain scatter)."""
        return self.degree // self.num_kv_heads if self.num_kv_heads < self.degree else 1

    @property
    def heads_per_chunk(self) -> int:
        return self.q_per_rank + 2 * self.kv_per_rank

    def kv_heads_of_rank(self, rank: int) -> List[int]:
        g = self.num_q_heads // self.num_kv_heads
        first = (rank * self.q_per_rank) // g
        last = ((rank + 1) * self.q_per_rank - 1) // g
        return list(range(first, last + 1))


def head_plan_error(num_q_heads: int, num_kv_heads: int, degree: int) -> Optional[str]:
    """Why these head counts cannot be split over ``degree`` ranks, or ``None``."""
    if num_q_heads < 1 or num_kv_heads < 1:
        return f"head counts must be >= 1 (query heads={num_q_heads}, kv heads={num_kv_heads})"
    if num_q_heads % num_kv_heads:
        return (
            f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) "
            "for grouped-query attention"
        )
    if num_q_heads % degree:
        return (
            f"ulysses degree {degree} must divide the {num_q_heads} query heads on this "
            f"tensor-parallel rank; choose a degree among "
            f"{[p for p in range(1, num_q_heads + 1) if num_q_heads % p == 0]}"
        )
    if num_kv_heads % degree and degree % num_kv_heads:
        return (
            f"ulysses degree {degree} and the {num_kv_heads} kv heads on this tensor-parallel "
            f"rank must divide one another (kv heads are scattered when degree divides them, "
            f"replicated when they divide the degree)"
        )
    return None


def _unreferenced(buf: torch.Tensor) -> bool:
    """True when nothing but the pool holds ``buf``'s storage (the temporary storage object
    made here accounts for the second reference)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2


class _BufferPool(threading.local):
    """A free list of CPU buffers for the exchange, per thread.

    On the CPU every fresh multi-MB tensor costs a page fault per 4 KB on first touch
    (measured: 20 ms for 25 MB -- as long as the all-to-all itself), and glibc returns large
    blocks to the OS on free, so each call would pay it again.  This pool hands out a
    buffer only when nothing else references its storage any more (send buffers right
    after their all-to-all; received q/k/v once the kernel's saved tensors are freed by the
    backward; outputs and gradients once the caller drops them), else allocates and keeps
    a new one, up to ``per_size`` buffers per size.  CUDA tensors bypass it: the CUDA
    caching allocator already does this.  ``ULYSSES_MCORE_POOL=0`` turns it off;
    :meth:`clear` returns the memory."""

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
    """A contiguous copy of ``view`` in a buffer no one else holds."""
    out = POOL.take(tuple(view.shape), view.dtype, view.device)
    out.copy_(view)
    return out.view(shape)


def head_layout_error(num_q_heads: int, num_kv_heads: int, degree: int) -> Optional[str]:
    """Why no Ulysses layout (even, or uneven: :mod:`ulysses_mcore.uneven`) fits, or ``None``."""
    if head_plan_error(num_q_heads, num_kv_heads, degree) is None:
        return None
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return head_plan_error(num_q_heads, num_kv_heads, degree)
    if num_q_heads < degree:
        return (f"ulysses degree {degree} is larger than the {num_q_heads} query heads on this tensor-parallel "
                f"rank: every rank needs at least one head; use a degree <= {num_q_heads} "
                "(ring context parallelism covers larger degrees)")
    return None  # uneven heads: per-rank split sizes


def is_even(num_q_heads: int, num_kv_heads: int, degree: int) -> bool:
    return head_plan_error(num_q_heads, num_kv_heads, degree) is None


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _a2a(output: torch.Tensor, inp: torch.Tensor, group) -> None:
    COLLECTIVE_CALLS["all_to_all_single"] += 1
    dist.all_to_all_single(output, inp, group=group)


def _pack_qkv(q, k, v, plan: HeadPlan) -> torch.Tensor:
    """One pass: send buffer ``[P, A, B, n, d]``, chunk j = rank j's q heads, then k, v heads."""
    P, qn, kn = plan.degree, plan.q_per_rank, plan.kv_per_rank
    A, B, _, d = q.shape
    send = POOL.take((P, A, B, plan.heads_per_chunk, d), q.dtype, q.device)
    send[..., :qn, :].copy_(q.unflatten(2, (P, qn)).permute(2, 0, 1, 3, 4))
    for off, t in ((qn, k), (qn + kn, v)):
        if plan.kv_replicas == 1:
            send[..., off : off + kn, :].copy_(t.unflatten(2, (P, kn)).permute(2, 0, 1, 3, 4))
        else:  # each kv head goes to kv_replicas consecutive ranks
            hk, rep = plan.num_kv_heads, plan.kv_replicas
            dst = send.view(hk, rep, A, B, plan.heads_per_chunk, d)[..., off : off + 1, :]
            dst.copy_(t.permute(2, 0, 1, 3)[:, None, :, :, None, :].expand_as(dst))
    return send


def _unpack_qkv_grad(buf: torch.Tensor, plan: HeadPlan):
    """Inverse of :func:`_pack_qkv` for gradients: replicas of a KV head are summed."""
    P, qn, kn = plan.degree, plan.q_per_rank, plan.kv_per_rank
    _, A, B, _, d = buf.shape
    dq = _fresh(buf[..., :qn, :].permute(1, 2, 0, 3, 4), (A, B, P * qn, d))
    out = [dq]
    for off in (qn, qn + kn):
        part = buf[..., off : off + kn, :]
        if plan.kv_replicas == 1:
            out.append(_fresh(part.permute(1, 2, 0, 3, 4), (A, B, P * kn, d)))
        else:
            hk, rep = plan.num_kv_heads, plan.kv_replicas
            summed = part.reshape(hk, rep, A, B, d).sum(1)  # [hk, A, B, d]
            out.append(summed.permute(1, 2, 0, 3).contiguous())
    return tuple(out)


def _recv_as_layout(recv: torch.Tensor, layout: str) -> torch.Tensor:
    """``[P, A, B, n, d]`` received by source rank -> the full-sequence tensor in ``layout``."""
    P, A, B, n, d = recv.shape
    if layout == "sbhd":
        return recv.view(P * A, B, n, d)  # source-major == token order: a view
    return recv.transpose(0, 1).reshape(A, P * B, n, d)  # a copy unless b == 1


def _layout_as_chunks(x: torch.Tensor, layout: str, P: int) -> torch.Tensor:
    """Full-sequence ``layout`` tensor -> ``[P, A, B, n, d]`` chunked by token block (contiguous;
    zero copies for contiguous sbhd, else one copy into a pooled buffer)."""
    if layout == "sbhd":
        S, b, n, d = x.shape
        if x.is_contiguous():
            return x.view(P, S // P, b, n, d)
        chunks = x.unflatten(0, (P, S // P))
    else:
        b, S, n, d = x.shape
        chunks = x.unflatten(1, (P, S // P)).transpose(0, 1)
    send = POOL.take(tuple(chunks.shape), x.dtype, x.device)
    send.copy_(chunks)
    return send


class SeqToHead(torch.autograd.Function):
    """q, k, v token shards -> full-sequence q, k, v of this rank's heads, in one collective."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan: HeadPlan, layout: str):
        ctx.group, ctx.plan, ctx.layout = group, plan, layout
        # 1. one copy: q, k, v -> one send buffer, chunk j holding rank j's heads
        send = _pack_qkv(q, k, v, plan)
        # 2. one collective
        recv = POOL.take(tuple(send.shape), send.dtype, send.device)
        _a2a(recv, send, group)
        # 3. the received buffer is the full sequence (sbhd: a view; bshd: one copy if b > 1)
        full = _recv_as_layout(recv, layout)
        qn, kn = plan.q_per_rank, plan.kv_per_rank
        return full[:, :, :qn], full[:, :, qn : qn + kn], full[:, :, qn + kn :]

    @staticmethod
    def backward(ctx, gq, gk, gv):
        plan, layout, P = ctx.plan, ctx.layout, ctx.plan.degree
        qn, kn = plan.q_per_rank, plan.kv_per_rank
        ref = next(g for g in (gq, gk, gv) if g is not None)
        seq_dim = 0 if layout == "sbhd" else 1
        S = ref.shape[seq_dim]
        shape = list(ref.shape)
        shape[seq_dim] = S // P
        shape[2] = plan.heads_per_chunk
        buf = POOL.take((P, *shape), ref.dtype, ref.device)
        # 1. one copy: the three gradients into the buffer the forward received
        for g, lo, hi in ((gq, 0, qn), (gk, qn, qn + kn), (gv, qn + kn, qn + 2 * kn)):
            if g is None:
                buf[..., lo:hi, :].zero_()
                continue
            chunks = g.unflatten(seq_dim, (P, S // P))
            buf[..., lo:hi, :].copy_(chunks if seq_dim == 0 else chunks.transpose(0, 1))
        # 2. one collective (the inverse permutation of the forward's)
        recv = POOL.take(tuple(buf.shape), buf.dtype, buf.device)
        _a2a(recv, buf, ctx.group)
        # 3. one copy back to [A, B, h, d]; replicated kv heads summed
        dq, dk, dv = _unpack_qkv_grad(recv, plan)
        return dq, dk, dv, None, None, None


class HeadToSeq(torch.autograd.Function):
    """Full-sequence output of this rank's heads -> token shard with every head, one collective."""

    @staticmethod
    def forward(ctx, out, group, degree: int, layout: str):
        ctx.group, ctx.degree, ctx.layout = group, degree, layout
        # 1. pack: zero copies when out is contiguous sbhd, else one
        send = _layout_as_chunks(out, layout, degree)
        recv = POOL.take(tuple(send.shape), send.dtype, send.device)
        # 2. one collective
        _a2a(recv, send, group)
        # 3. one copy: [P(src heads), A, B, n, d] -> [A, B, P*n, d]
        P, A, B, n, d = recv.shape
        return _fresh(recv.permute(1, 2, 0, 3, 4), (A, B, P * n, d))

    @staticmethod
    def backward(ctx, g):
        P = ctx.degree
        n = g.shape[2] // P
        chunks = g.unflatten(2, (P, n)).permute(2, 0, 1, 3, 4)
        send = POOL.take(tuple(chunks.shape), g.dtype, g.device)
        send.copy_(chunks)
        recv = POOL.take(tuple(send.shape), send.dtype, send.device)
        _a2a(recv, send, ctx.group)
        return _recv_as_layout(recv, ctx.layout), None, None, None


def seq_to_head(q, k, v, group, plan: HeadPlan, layout: str = "sbhd"):
    """Differentiable: token-sharded q, k, v -> this rank's heads over the full sequence."""
    if plan.degree == 1:
        return q, k, v
    return SeqToHead.apply(q, k, v, group, plan, layout)


def head_to_seq(out, group, degree: int, layout: str = "sbhd"):
    """Differentiable: this rank's heads over the full sequence -> token shard, all heads."""
    if degree == 1:
        return out
    return HeadToSeq.apply(out, group, degree, layout)


# ----------------------------------------------------------------------------------
# Single-process references (no collective): what every rank should end up holding.
# ----------------------------------------------------------------------------------
def reference_seq_to_head(
    full: torch.Tensor, rank: int, plan: HeadPlan, kind: str, layout: str = "sbhd"
) -> torch.Tensor:
    """Heads of ``rank`` from the full-sequence tensor: ``kind`` is 'q' or 'kv'."""
    if kind == "q":
        heads = list(range(rank * plan.q_per_rank, (rank + 1) * plan.q_per_rank))
    else:
        heads = plan.kv_heads_of_rank(rank)
    return full[:, :, heads]


def shard_tokens(full: torch.Tensor, rank: int, degree: int, layout: str = "sbhd") -> torch.Tensor:
    """Contiguous token shard ``rank`` of ``degree`` of a full-sequence tensor."""
    dim = 0 if layout == "sbhd" else 1
    return full.chunk(degree, dim=dim)[rank]
