"""The one pair of autograd all-to-alls between token-sharded and head-sharded tensors:
``SeqToHead`` (q, k, v ``[s/P, b, h, d]`` -> ``[s, b, h_r, d]``) and ``HeadToSeq`` (the output
back), each ONE ``all_to_all_single`` over the routes of :mod:`ulysses_mcore.exchange.routes`,
and the log-sum-exp's ride on the output's exchange.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .heads import HeadPlan, seq_dim
from .routes import OutRoute, QkvRoute, out_route, qkv_route


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
