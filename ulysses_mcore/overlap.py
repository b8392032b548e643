"""Ulysses attention with communication overlapped with computation (head chunks).

The heads each rank computes are cut into ``C`` chunks.  Forward: every chunk's q/k/v
all-to-all is issued asynchronously up front; chunk ``c``'s attention runs while chunks
``c+1 ...`` are still in flight, and its output all-to-all is issued (async) as soon as it
is computed, overlapping the next chunk's attention.  Backward mirrors it: the output
gradients of every chunk travel asynchronously, chunk ``c``'s kernel backward runs while
later chunks arrive, and its dq/dk/dv all-to-all overlaps chunk ``c+1``'s backward.

Chunk ``c`` holds, for every destination rank ``j``, query heads
``j*q/P + c*q/(P*C) ...`` and the kv heads they use, so every chunk is itself a valid
Ulysses exchange and a group's query heads stay with their kv heads.  Needs ``C`` to
divide the query and kv heads per rank (kv replication, ``kv heads < P``, allows C = 1
only).  Collectives: ``2C`` forward, ``2C`` backward.  ``C = 1`` is the plain path in
:mod:`ulysses_mcore.attention`.  Exchange, buffers and layout helpers are
:mod:`ulysses_mcore.exchange`'s; the kernel runs under autograd inside this function's forward
(its backward replays it chunk by chunk).
"""

from __future__ import annotations

import torch

from torch.autograd.function import once_differentiable

from .exchange import POOL, HeadPlan, _layout_as_chunks, _recv_as_layout, all_to_all, seq_dim


def _a2a_async(out, inp, group):
    return all_to_all(out, inp, group, async_op=True)


def _pack_chunk(send, parts, offsets):
    """Write chunk views ``[A, B, P, n, d]`` into ``send [P, A, B, N, d]`` at head offsets."""
    for part, (lo, hi) in zip(parts, offsets):
        send[..., lo:hi, :].copy_(part.permute(2, 0, 1, 3, 4))


class OverlappedUlysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan: HeadPlan, layout: str, chunks: int, run_kernel):
        P, C = plan.degree, chunks
        qc, kc = plan.q_count(0) // C, plan.kv_count(0) // C
        n = qc + 2 * kc
        A, B, hq, d = q.shape
        offs = ((0, qc), (qc, qc + kc), (qc + kc, n))
        qv, kv, vv = (t.unflatten(2, (P, C, t.shape[2] // (P * C))) for t in (q, k, v))
        sends, recvs, works = [], [], []
        for c in range(C):  # 1. every chunk's q/k/v exchange goes out at once
            send = POOL.take((P, A, B, n, d), q.dtype, q.device)
            _pack_chunk(send, (qv[:, :, :, c], kv[:, :, :, c], vv[:, :, :, c]), offs)
            recv = torch.empty_like(send)  # kept: the kernel saves views of it
            works.append(_a2a_async(recv, send, group))
            sends.append(send)
            recvs.append(recv)
        leaves, outs, out_sends, out_recvs, out_works = [], [], [], [], []
        for c in range(C):  # 2. attention of chunk c overlaps the exchanges of the others
            works[c].wait()
            full = _recv_as_layout(recvs[c], layout)
            lq, lk, lv = (full[:, :, lo:hi].detach().requires_grad_() for lo, hi in offs)
            with torch.enable_grad():
                o = run_kernel(lq, lk, lv, c)
            leaves.append((lq, lk, lv))
            outs.append(o)
            send_o = _layout_as_chunks(o.detach(), layout, P)
            recv_o = POOL.take(tuple(send_o.shape), o.dtype, o.device)
            out_works.append(_a2a_async(recv_o, send_o, group))  # 3. overlaps chunk c+1's attention
            out_sends.append(send_o)
            out_recvs.append(recv_o)
        result = q.new_empty(A, B, hq, d)
        rv = result.view(A, B, P, C, qc, d)
        for c in range(C):
            out_works[c].wait()
            rv[:, :, :, c].copy_(out_recvs[c].permute(1, 2, 0, 3, 4))
        del sends, out_sends, out_recvs
        ctx.group, ctx.plan, ctx.layout, ctx.chunks = group, plan, layout, C
        ctx.leaves, ctx.outs = leaves, outs
        ctx.shapes = (q.shape, k.shape)
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        P, C, layout, group = ctx.plan.degree, ctx.chunks, ctx.layout, ctx.group
        plan = ctx.plan
        qc, kc = plan.q_count(0) // C, plan.kv_count(0) // C
        n = qc + 2 * kc
        (A, B, hq, d), kshape = ctx.shapes
        gv = g.unflatten(2, (P, C, qc))
        sends, recvs, works = [], [], []
        for c in range(C):  # 1. every chunk's output gradient goes out at once
            send = POOL.take((P, A, B, qc, d), g.dtype, g.device)
            send.copy_(gv[:, :, :, c].permute(2, 0, 1, 3, 4))
            recv = torch.empty_like(send)
            works.append(_a2a_async(recv, send, group))
            sends.append(send)
            recvs.append(recv)
        dq = g.new_empty(A, B, hq, d)
        dk = g.new_empty(kshape)
        dvv = g.new_empty(kshape)
        views = (dq.view(A, B, P, C, qc, d), dk.view(A, B, P, C, kc, d), dvv.view(A, B, P, C, kc, d))
        offs = ((0, qc), (qc, qc + kc), (qc + kc, n))
        back_sends, back_recvs, back_works = [], [], []
        for c in range(C):  # 2. kernel backward of chunk c overlaps the others' exchanges
            works[c].wait()
            go = _recv_as_layout(recvs[c], layout)
            lq, lk, lv = ctx.leaves[c]
            torch.autograd.backward(ctx.outs[c], go)
            ctx.outs[c] = None
            sd = seq_dim(layout)
            S = lq.shape[sd]
            shape = list(lq.shape)
            shape[sd] = S // P
            shape[2] = n
            buf = POOL.take((P, *shape), g.dtype, g.device)
            for leaf, (lo, hi) in zip((lq, lk, lv), offs):
                gr = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                ch = gr.unflatten(sd, (P, S // P))
                buf[..., lo:hi, :].copy_(ch if sd == 0 else ch.transpose(0, 1))
            recv = POOL.take(tuple(buf.shape), g.dtype, g.device)
            back_works.append(_a2a_async(recv, buf, group))  # 3. overlaps chunk c+1's backward
            back_sends.append(buf)
            back_recvs.append(recv)
        for c in range(C):
            back_works[c].wait()
            r = back_recvs[c]
            for view, (lo, hi) in zip(views, offs):
                view[:, :, :, c].copy_(r[..., lo:hi, :].permute(1, 2, 0, 3, 4))
        ctx.leaves = None
        return dq, dk, dvv, None, None, None, None, None
