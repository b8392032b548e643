"""Uneven heads: Ulysses when the heads per tensor-parallel rank do not divide the degree.

Query heads are split as evenly as possible (the first ``hq % P`` ranks get one more), so
7 heads at P = 4 compute 2, 2, 2, 1 -- no padded heads, no wasted attention FLOPs.  Each
rank receives exactly the kv heads its query heads use (``first_q // g ... last_q // g``
with ``g = hq / hk``); a kv head whose group straddles two ranks goes to both, and the
backward sums the two gradients.  The all-to-alls carry per-rank split sizes.

Inside the kernel a rank's query heads need not start at a kv-group boundary (28 q / 7
kv at P = 4: rank 1 holds q 7-13 -> kv 1, 2, 2, 2, 2, 3, 3), so the kv heads are expanded
to one per query head before an ordinary kernel runs -- what Megatron's
``DotProductAttention`` does for every GQA model.

Copies: forward pack 1 (q/k/v into one send buffer), unpack 0 (sbhd) + the kv expansion;
output pack 0-1, unpack 1; backward mirrors it.  One all-to-all each way, as on the even path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from . import comm


@dataclass(frozen=True)
class UnevenPlan:
    num_q_heads: int
    num_kv_heads: int
    degree: int

    def q_range(self, rank: int):
        base, extra = divmod(self.num_q_heads, self.degree)
        first = rank * base + min(rank, extra)
        return first, first + base + (1 if rank < extra else 0)

    def q_count(self, rank: int) -> int:
        lo, hi = self.q_range(rank)
        return hi - lo

    def kv_heads(self, rank: int) -> List[int]:
        g = self.num_q_heads // self.num_kv_heads
        lo, hi = self.q_range(rank)
        return list(range(lo // g, (hi - 1) // g + 1))

    def chunk_heads(self, rank: int) -> int:
        return self.q_count(rank) + 2 * len(self.kv_heads(rank))

    def kv_index_for_q(self, rank: int) -> List[int]:
        """Local kv head (index into ``kv_heads(rank)``) of each local query head."""
        g = self.num_q_heads // self.num_kv_heads
        lo, hi = self.q_range(rank)
        first_kv = lo // g
        return [q // g - first_kv for q in range(lo, hi)]


def _sizes(A, B, d, counts):
    return [A * B * n * d for n in counts]


class UnevenSeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan: UnevenPlan, layout: str):
        P, me = plan.degree, dist.get_rank(group)
        A, B, _, d = q.shape
        ctx.group, ctx.plan, ctx.layout, ctx.kshape = group, plan, layout, k.shape
        # 1. one copy: for each destination j, [A, B, n_j, d] = its query heads, then its kv heads
        counts = [plan.chunk_heads(j) for j in range(P)]
        send = q.new_empty(sum(_sizes(A, B, d, counts)))
        off = 0
        for j in range(P):
            lo, hi = plan.q_range(j)
            kvs = plan.kv_heads(j)
            nq, nkv = hi - lo, len(kvs)
            blk = send[off:off + A * B * counts[j] * d].view(A, B, counts[j], d)
            off += A * B * counts[j] * d
            blk[:, :, :nq] = q[:, :, lo:hi]
            blk[:, :, nq:nq + nkv] = k[:, :, kvs[0]:kvs[-1] + 1]
            blk[:, :, nq + nkv:] = v[:, :, kvs[0]:kvs[-1] + 1]
        n_me = counts[me]
        recv = q.new_empty(P * A * B * n_me * d)  # split sizes count dim-0 entries: keep buffers flat
        comm.COLLECTIVE_CALLS["all_to_all_single"] += 1
        dist.all_to_all_single(recv, send, output_split_sizes=_sizes(A, B, d, [n_me] * P),
                               input_split_sizes=_sizes(A, B, d, counts), group=group)
        full = comm._recv_as_layout(recv.view(P, A, B, n_me, d), layout)
        nq, nkv = plan.q_count(me), len(plan.kv_heads(me))
        return full[:, :, :nq], full[:, :, nq:nq + nkv], full[:, :, nq + nkv:]

    @staticmethod
    def backward(ctx, gq, gk, gv):
        plan, layout, group = ctx.plan, ctx.layout, ctx.group
        P, me = plan.degree, dist.get_rank(group)
        ref = next(g for g in (gq, gk, gv) if g is not None)
        seq_dim = 0 if layout == "sbhd" else 1
        S = ref.shape[seq_dim]
        nq, nkv = plan.q_count(me), len(plan.kv_heads(me))
        parts = []
        for g_, n in ((gq, nq), (gk, nkv), (gv, nkv)):
            if g_ is None:
                shape = list(ref.shape)
                shape[2] = n
                g_ = ref.new_zeros(shape)
            ch = g_.unflatten(seq_dim, (P, S // P))
            parts.append(ch if seq_dim == 0 else ch.transpose(0, 1))  # [P, A, B, n, d]
        send = torch.cat(parts, dim=3).contiguous()  # 1 copy: what the forward received
        _, A, B, _, d = send.shape
        counts = [plan.chunk_heads(j) for j in range(P)]
        recv = send.new_empty(sum(_sizes(A, B, d, counts)))
        comm.COLLECTIVE_CALLS["all_to_all_single"] += 1
        dist.all_to_all_single(recv, send.reshape(-1), output_split_sizes=_sizes(A, B, d, counts),
                               input_split_sizes=_sizes(A, B, d, [counts[me]] * P), group=group)
        dq = send.new_empty(A, B, plan.num_q_heads, d)
        dk = send.new_zeros(ctx.kshape)
        dv = send.new_zeros(ctx.kshape)
        off = 0
        for j in range(P):  # replicated kv heads (shared by two ranks) are summed here
            lo, hi = plan.q_range(j)
            kvs = plan.kv_heads(j)
            n = counts[j]
            blk = recv[off:off + A * B * n * d].view(A, B, n, d)
            off += A * B * n * d
            dq[:, :, lo:hi] = blk[:, :, :hi - lo]
            dk[:, :, kvs[0]:kvs[-1] + 1] += blk[:, :, hi - lo:hi - lo + len(kvs)]
            dv[:, :, kvs[0]:kvs[-1] + 1] += blk[:, :, hi - lo + len(kvs):]
        return dq, dk, dv, None, None, None


class UnevenHeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, group, plan: UnevenPlan, layout: str):
        P = plan.degree
        ctx.group, ctx.plan, ctx.layout = group, plan, layout
        send = comm._layout_as_chunks(out, layout, P)  # [P, A, B, nq_me, d]
        _, A, B, n_me, d = send.shape
        counts = [plan.q_count(j) for j in range(P)]
        recv = send.new_empty(sum(_sizes(A, B, d, counts)))
        comm.COLLECTIVE_CALLS["all_to_all_single"] += 1
        dist.all_to_all_single(recv, send.reshape(-1), output_split_sizes=_sizes(A, B, d, counts),
                               input_split_sizes=_sizes(A, B, d, [n_me] * P), group=group)
        blocks, off = [], 0
        for n in counts:
            blocks.append(recv[off:off + A * B * n * d].view(A, B, n, d))
            off += A * B * n * d
        return torch.cat(blocks, dim=2)  # 1 copy: [A, B, hq, d]

    @staticmethod
    def backward(ctx, g):
        plan, layout, group = ctx.plan, ctx.layout, ctx.group
        P, me = plan.degree, dist.get_rank(group)
        A, B, _, d = g.shape
        n_me = plan.q_count(me)
        counts = [plan.q_count(j) for j in range(P)]
        send = torch.cat([g[:, :, plan.q_range(j)[0]:plan.q_range(j)[1]].reshape(-1) for j in range(P)])
        recv = g.new_empty(P * A * B * n_me * d)
        comm.COLLECTIVE_CALLS["all_to_all_single"] += 1
        dist.all_to_all_single(recv, send, output_split_sizes=_sizes(A, B, d, [n_me] * P),
                               input_split_sizes=_sizes(A, B, d, counts), group=group)
        return comm._recv_as_layout(recv.view(P, A, B, n_me, d), layout), None, None, None


def expand_kv(k: torch.Tensor, plan: UnevenPlan, rank: int) -> torch.Tensor:
    """One kv head per local query head (non-uniform groups)."""
    idx = torch.tensor(plan.kv_index_for_q(rank), device=k.device)
    return k.index_select(2, idx)
