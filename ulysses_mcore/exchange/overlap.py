"""Ulysses attention with the all-to-alls overlapped with the kernel, head chunk by head chunk:
``C`` chunks, each a regular exchange of its heads on :mod:`ulysses_mcore.exchange.routes`' own
routes; forward and backward each ``2C`` asynchronous collectives, chunk ``c``'s kernel running
while the others travel (docs/design.md, "The core, module by module").
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .heads import HeadPlan
from .routes import OutRoute, QkvRoute, Shard
from .transport import POOL


class ChunkRoutes:
    """The routes of one chunk (all chunks have the same shape), made once per prepared call."""

    def __init__(self, plan: HeadPlan, rank: int, chunks: int, shard: Shard, layout: str):
        ulysses, C = plan.ulysses, chunks
        self.ulysses, self.C, self.qc, self.kc = ulysses, C, plan.q_count(0) // C, plan.kv_count(0) // C
        chunk_plan = HeadPlan(ulysses * self.qc, ulysses * self.kc, ulysses)
        self.qkv = QkvRoute(chunk_plan, rank, shard, layout)
        self.out = OutRoute(chunk_plan, rank, shard, layout)

    def views(self, t: torch.Tensor, n: int, c: int) -> torch.Tensor:
        """Chunk ``c``'s ``[A, B, P, n, d]`` heads of a token shard ``[A, B, P*C*n, d]``."""
        return t.unflatten(2, (self.ulysses, self.C, n)).select(3, c)


class OverlappedUlysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, job):
        """``job = (routes, run_kernel)``: the prepared call's :class:`ChunkRoutes` and the kernel on
        chunk ``c``'s heads, ``run_kernel(q, k, v, c)``."""
        routes, run_kernel = job
        C, qc, kc = routes.C, routes.qc, routes.kc
        pending = []
        for c in range(C):  # 1. every chunk's q/k/v exchange goes out at once
            send = POOL.take(routes.qkv.send_shape, q.dtype, q.device)
            routes.qkv.pack(routes.views(q, qc, c), routes.views(k, kc, c), routes.views(v, kc, c), send)
            pending.append(routes.qkv.start(send, group, async_op=True))
        result = q.new_empty(q.shape)
        leaves, outs, out_pending = [], [], []
        for c, (recv, work, _) in enumerate(pending):  # 2. chunk c's attention overlaps the others' exchanges
            work.wait()
            lq, lk, lv = (t.detach().requires_grad_() for t in routes.qkv.received(recv))
            with torch.enable_grad():
                o = run_kernel(lq, lk, lv, c)
            leaves.append((lq, lk, lv))
            outs.append(o)
            out_pending.append(routes.out.start(o.detach(), group, async_op=True))  # 3. overlaps chunk c+1
        for c, (recv, work, _) in enumerate(out_pending):
            work.wait()
            routes.out.finish(recv, routes.views(result, qc, c))
        ctx.group, ctx.routes, ctx.leaves, ctx.outs = group, routes, leaves, outs
        ctx.kv_shape = k.shape
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        routes, group = ctx.routes, ctx.group
        C, qc, kc = routes.C, routes.qc, routes.kc
        pending = [
            routes.out.start_grad(None, group, async_op=True, g5=routes.views(g, qc, c)) for c in range(C)
        ]  # 1. every chunk's output gradient goes out at once
        dq, dk, dv = g.new_empty(g.shape), g.new_empty(ctx.kv_shape), g.new_empty(ctx.kv_shape)
        back = []
        for c, (recv, work, _) in enumerate(pending):  # 2. chunk c's kernel backward overlaps the others
            work.wait()
            torch.autograd.backward(ctx.outs[c], routes.out.finish_grad(recv))
            ctx.outs[c] = None
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in ctx.leaves[c]]
            back.append(routes.qkv.start_grad(*grads, group, async_op=True))  # 3. overlaps chunk c+1's
        for c, (recv, work, _) in enumerate(back):
            work.wait()
            routes.qkv.unpack_grad(recv, routes.views(dq, qc, c), routes.views(dk, kc, c), routes.views(dv, kc, c))
        ctx.leaves = None
        return dq, dk, dv, None, None
