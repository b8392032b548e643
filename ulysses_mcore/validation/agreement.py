"""The per-call agreements of ``check="every_call"`` and the trainer: a call signature as a digest
that is the same in every process, and one small all-reduce that tells a group whether every rank
holds the same value (so a rank never raises alone).
"""

from __future__ import annotations

import hashlib
from dataclasses import fields

import torch
import torch.distributed as dist

from ..exchange.transport import is_fake_group
from ..options import CallSite


def _stable(x):
    """``x`` with what differs between processes for the same call made uniform (group objects by
    size, devices by type, callables by name): the basis of :func:`digest`."""
    if isinstance(x, (tuple, list)):
        return tuple(_stable(y) for y in x)
    if isinstance(x, torch.Size):
        return tuple(x)
    if isinstance(x, (torch.dtype, str, int, float, bool)) or x is None:
        return str(x)
    if isinstance(x, torch.device):
        return x.type
    if isinstance(x, dist.ProcessGroup):
        return ("group", x.size())
    if isinstance(x, CallSite):  # field by field, callables by name
        return tuple((f.name, _stable(getattr(x, f.name))) for f in fields(x))
    if callable(x) and not isinstance(x, type):
        return "callable"
    return type(x).__name__


def digest(key) -> int:
    """A call signature as a 62-bit integer, the same in every process for the same call."""
    return int.from_bytes(hashlib.blake2b(repr(_stable(key)).encode(), digest_size=8).digest(), "little") >> 2


def agree(value: int, group, device=None) -> bool:
    """Whether every rank of ``group`` holds ``value`` (one all-reduce of two int64: max of v and -v).
    A fake world's ranks are all this rank: they agree."""
    if is_fake_group(group):
        return True
    t = torch.tensor([value, -value], dtype=torch.int64, device=_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = t.tolist()
    return high == -neg_low


def _device(group, device=None):
    """Where a collective of ``group`` runs: the CPU for gloo (and the test backends), ``device`` --
    by default the current CUDA device -- for NCCL."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


def boundaries_digest(t, device) -> torch.Tensor:
    """A digest of document boundaries (or lengths) computed on their own device, no host read:
    ``sum_i t_i (2i + 1) + 1000003 n`` as an int64 scalar (``0`` for ``None``), moved to ``device``."""
    if t is None:
        return torch.zeros((), dtype=torch.int64, device=device)
    v = t.to(torch.int64)
    weights = torch.arange(1, 2 * v.numel(), 2, dtype=torch.int64, device=v.device)
    return ((v * weights).sum() + 1000003 * v.numel()).to(device)


def agree_call(sig: int, bounds, new: bool, group, device):
    """``(same, anyone_new)`` over ``group`` in one all-reduce (MAX) of five int64: the signature
    digest and its negation, whether this rank meets the signature for the first time, the digest
    of the document boundaries (``bounds``: ``(cu_seqlens, seqlens)``, computed on their device, so
    this reads nothing on the host but the all-reduce's result) and its negation.  A fake world's
    ranks are all this rank."""
    if is_fake_group(group):
        return True, new
    dev = _device(group, device)
    b = boundaries_digest(bounds[0], dev) * 31 + boundaries_digest(bounds[1], dev)
    head = torch.tensor([sig, -sig, int(new)], dtype=torch.int64, device=dev)
    t = torch.cat([head, torch.stack([b, -b])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    high, neg_low, anyone_new, b_high, neg_b_low = t.tolist()
    return high == -neg_low and b_high == -neg_b_low, bool(anyone_new)


__all__ = ["agree", "agree_call", "boundaries_digest", "digest"]
