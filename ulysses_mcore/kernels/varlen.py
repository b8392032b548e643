"""Packed documents for the fused kernels: the boundaries a varlen kernel takes, the rows that are
real tokens, a window as the kernels spell it, and one varlen call over documents padded in their
slots -- everything device-side, nothing read on the host unless the caller gives no bound."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..exchange.orders import document_ids, host_bounds
from ..options import has_window


def kernel_window(kw, none=(-1, -1)):
    """The window a flash / TE kernel takes: ``kw["window_size"]`` as a tuple, or ``none``."""
    return tuple(kw["window_size"]) if has_window(kw.get("window_size")) else none


def interleaved_boundaries(cu_seqlens: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """Padded documents as a varlen kernel can run them without reading anything on the host:
    ``[c0, c0+l0, c1, c1+l1, ..., cn]`` -- each document's real tokens one sequence, its pad
    another (attending only to itself; its rows are zeroed afterwards)."""
    cu = cu_seqlens.to(torch.int64)
    lens = seqlens.to(device=cu.device, dtype=torch.int64)
    pairs = torch.stack([cu[:-1], cu[:-1] + lens], dim=1).reshape(-1)
    return torch.cat([pairs, cu[-1:]])


def real_token_rows(cu_seqlens: torch.Tensor, seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` bool: which positions of the padded stream are real tokens (device-side)."""
    cu = cu_seqlens.to(torch.int64)
    doc = document_ids(cu, total)
    lens = seqlens.to(device=cu.device, dtype=torch.int64)
    return torch.arange(total, device=cu.device) - cu[doc] < lens[doc]


def varlen_args(cu_seqlens, device, max_seqlen=None):
    """(int32 cu_seqlens on ``device``, longest document) for the varlen kernels: ``max_seqlen``
    from the caller (Megatron's ``PackedSeqParams.max_seqlen_q``, a bound is enough), else read
    off the boundaries (a device-to-host sync on a GPU)."""
    if max_seqlen is None:
        bounds = host_bounds(cu_seqlens)
        max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return cu_seqlens.to(device=device, dtype=torch.int32), int(max_seqlen)


def first_output(out):
    """The output of a kernel that returns it alone or first in a tuple (with its log-sum-exp, ...)."""
    return out[0] if isinstance(out, tuple) else out


class Documents(NamedTuple):
    """Packed documents: ``cu`` (int ``[n+1]``, the boundaries), ``seqlens`` (int ``[n]``, real lengths
    inside padded slots, or None) and ``max_seqlen`` (a host bound on the longest, or None)."""

    cu: torch.Tensor
    seqlens: Optional[torch.Tensor] = None
    max_seqlen: Optional[int] = None


def padded_varlen(varlen, args, qkv, docs: Documents):
    """``qkv``: packed documents (``[t, 1, h, d]`` each) through a varlen kernel called as
    ``varlen(q, k, v, cu_q, cu_k, max_q, max_k, **args)`` (flash-attn's and torch's order); with
    ``seqlens`` (documents padded in their slots) each pad runs as a sequence of its own and its
    rows are zeroed: nothing is read on the host."""
    (q, k, v), (cu, seqlens, max_seqlen) = qkv, docs
    bounds = cu if seqlens is None else interleaved_boundaries(cu, seqlens)
    cu32, maxlen = varlen_args(bounds, q.device, max_seqlen)
    both = (cu32, cu32, maxlen, maxlen)  # queries' and keys' boundaries and longest: the same documents
    out = first_output(varlen(q[:, 0], k[:, 0], v[:, 0], *both, **args)).unsqueeze(1)
    if seqlens is None:
        return out
    real = real_token_rows(cu, seqlens, q.shape[0])[:, None, None, None]
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))
