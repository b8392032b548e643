"""Routes: everything about an exchange that depends only on the call's shape, worked out once:
buffer shapes, split sizes and each part's place (:class:`QkvRoute`, :class:`OutRoute`).  Q, K and
V cross in one packed buffer whose received form *is* the attention input (``sbhd``: a view).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .heads import HeadPlan, seq_dim
from .transport import POOL, all_to_all


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
class Shard(NamedTuple):
    """A token shard's shape around its heads: ``[A, B, heads, d]`` (``sbhd``: ``A, B = s/P, b``;
    ``bshd``: ``b, s/P``); ``dv``: the value's head dim where it differs (multi-latent attention)."""

    A: int
    B: int
    d: int
    dv: Optional[int] = None

    def with_dv(self) -> Shard:
        return self if self.dv is not None else self._replace(dv=self.d)


class QkvRoute:
    """The q/k/v exchange of one call shape, worked out once (cached with the prepared call):
    buffer shapes, split sizes, and each part's place as precomputed strided views, so a call
    makes views with one C call each and copies.  ``A, B``: the two dims before the heads of a
    token shard (``sbhd``: ``s/P, b``; ``bshd``: ``b, s/P``).

    Regular plans pack with one strided copy per tensor from 5-D per-destination views
    ``[A, B, P, n, d]`` (which is also how a head chunk of :mod:`ulysses_mcore.exchange.overlap` is
    given); other plans walk the destinations (uneven heads, kv groups straddling ranks)."""

    def __init__(self, plan: HeadPlan, rank: int, shard: Shard, layout: str):
        ulysses, (A, B, dq, dv) = plan.ulysses, shard.with_dv()
        self.plan, self.layout, self.sd, self.ulysses = plan, layout, seq_dim(layout), ulysses
        self.A, self.B, self.dq, self.dv = A, B, dq, dv
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
        return recv, all_to_all(recv, send, group, self.recv_splits, self.send_splits, async_op=async_op), send

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
        return recv, all_to_all(recv, buf, group, self.send_splits, self.recv_splits, async_op=async_op), buf

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

    def __init__(self, plan: HeadPlan, rank: int, shard: Shard, layout: str):
        ulysses, (A, B, d, _) = plan.ulysses, shard
        self.plan, self.layout, self.sd, self.ulysses = plan, layout, seq_dim(layout), ulysses
        self.A, self.B, self.d = A, B, d
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
        return recv, all_to_all(recv, send, group, self.sizes, self.mine, async_op=async_op), send

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
        return recv, all_to_all(recv, send, group, self.mine, self.sizes, async_op=async_op), send

    def finish_grad(self, recv: torch.Tensor) -> torch.Tensor:
        if self.sd == 0:
            return recv.view(self.full)
        return _recv_as_layout(recv, self.layout)


def qkv_route(q, v, plan: HeadPlan, rank: int, layout: str) -> QkvRoute:
    return QkvRoute(plan, rank, Shard(q.shape[0], q.shape[1], q.shape[3], v.shape[3]), layout)


def out_route(out_shard_shape, d: int, plan: HeadPlan, rank: int, layout: str) -> OutRoute:
    """The output route for token shards of ``out_shard_shape`` (``[A, B, ...]``) and head dim ``d``."""
    return OutRoute(plan, rank, Shard(out_shard_shape[0], out_shard_shape[1], d), layout)
