"""Ring attention over the ring context-parallel group: the tiled log-sum-exp engine
(:mod:`ulysses_mcore.kernels.tiled`) with the key/value blocks travelling round the ring -- the
portable version (CPU/gloo, any backend) of Transformer Engine's p2p context parallelism.
``C`` asynchronous shifts forward; in the backward the ``dk``/``dv`` partial sums travel behind
their block and one last shift brings them home (docs/design.md, "The core, module by module").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..exchange.transport import all_to_all
from .blocks import Segments
from .tiled import lse_attention


def ring_segments(rank: int, size: int, seq_len: int, token_order: str) -> Segments:
    """Global positions held by ring rank ``rank``: one or two ``(start, length)`` segments."""
    if token_order == "load_balanced":
        n = seq_len // (2 * size)
        return [(rank * n, n), ((2 * size - 1 - rank) * n, n)]
    n = seq_len // size
    return [(rank * n, n)]


class Ring(NamedTuple):
    """The ring a call's key blocks travel: its process ``group`` and the token order of its shards
    (what :class:`ulysses_mcore.kernels.tiled.Walk` asks of a ring)."""

    group: Any
    token_order: str

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def segments(self, rank: int, seq_len: int) -> Segments:
        return ring_segments(rank, self.size, seq_len, self.token_order)

    def shift(self, buf: torch.Tensor):
        """Send ``buf`` to the next ring rank, receive the previous rank's: ``(recv, work)``."""
        C, me = self.size, self.rank
        flat = buf.reshape(-1)
        n = flat.numel()
        recv = torch.empty_like(flat)
        nxt, prv = (me + 1) % C, (me - 1) % C
        in_splits = [n if r == nxt else 0 for r in range(C)]
        out_splits = [n if r == prv else 0 for r in range(C)]
        work = all_to_all(recv, flat, self.group, out_splits, in_splits, async_op=True)
        return recv.view(buf.shape), work


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, token_order="load_balanced", **kw):
    """Exact attention of this ring rank's tokens against the whole sequence spread over ``group``
    (``None`` or one rank: the whole sequence is here), the shards in ``token_order``; every other
    keyword (causality, scale, layout, mask, bias, documents, window, sinks, ``return_lse``, tile)
    as :func:`ulysses_mcore.kernels.tiled.lse_attention` takes it, ``cu_seqlens`` global."""
    ring = None if group is None or dist.get_world_size(group) == 1 else Ring(group, token_order)
    return lse_attention(q, k, v, ring=ring, **kw)
