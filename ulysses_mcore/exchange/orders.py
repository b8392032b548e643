"""Token orders of a sharded sequence (``"contiguous"``, ``"load_balanced"``: Megatron's dual
chunks, ``"per_document"``: the THD layout's) and the index tensors that turn the received order
(rank 0's tokens, then rank 1's, ...) into the natural one around the kernel and back: worked out
once per prepared call, per batch for per-document orders.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch

TOKEN_ORDERS = ("contiguous", "load_balanced", "per_document")
Reorder = Callable[[torch.Tensor], torch.Tensor]


def load_balanced_permutation(ulysses: int) -> List[int]:
    """Megatron's dual-chunk order: the sequence is cut into ``2P`` chunks and rank ``r``
    holds chunks ``r`` and ``2P-1-r``.  Entry ``p`` is the natural chunk at position ``p``
    of the rank-ordered (received) sequence: ``[0, 2P-1, 1, 2P-2, ...]``."""
    return [p // 2 if p % 2 == 0 else 2 * ulysses - 1 - p // 2 for p in range(2 * ulysses)]


def document_ids(cu_seqlens: torch.Tensor, total: int, device=None) -> torch.Tensor:
    """Document index of each position of a packed stream of ``total`` tokens, on ``device``
    (default: ``cu_seqlens``' own device; nothing is read on the host)."""
    device = cu_seqlens.device if device is None else device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    return torch.bucketize(torch.arange(total, device=device), cu[1:], right=True)


class PerBatch(threading.local):
    """What is derived from the current micro-batch's document tensors (their host values, the
    document lengths), worked out by the first layer that meets a tensor and read by the rest: one
    slot per kind holding the last tensor given (and its version), per thread."""

    def __init__(self):
        self.slots: dict = {}

    def derived(self, kind: str, fn: Callable[[torch.Tensor], object], t: torch.Tensor):
        """``fn(t)``, kept as ``kind`` until another tensor (or a change to ``t``) comes."""
        held = self.slots.get(kind)
        if held is None or held[0] is not t or held[1] != t._version:
            held = self.slots[kind] = (t, t._version, fn(t))
        return held[2]

    def clear(self) -> None:
        self.slots.clear()


BATCH = PerBatch()


def _host_values(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.tolist())  # one read per micro-batch (a sync for a GPU tensor)


def host_bounds(cu_seqlens: torch.Tensor) -> Tuple[int, ...]:
    """``cu_seqlens`` on the host, read once per micro-batch."""
    return BATCH.derived("host bounds", _host_values, cu_seqlens)


def host_lengths(seqlens: torch.Tensor) -> Tuple[int, ...]:
    """Real document lengths inside padded slots, on the host, read once per micro-batch."""
    return BATCH.derived("host lengths", _host_values, seqlens)


def per_document_order(cu_seqlens: torch.Tensor, ulysses: int, total: Optional[int] = None) -> torch.Tensor:
    """Transformer Engine's / Megatron's THD context-parallel layout: every document (length a
    multiple of ``2P``) is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and
    ``2P-1-r`` of each, documents in order.  Returns the natural position of each token of
    the concatenation of ranks ``0 .. P-1`` (what the all-to-all delivers), on ``cu_seqlens``'
    device.  Vectorised and sync-free when ``total`` (the stream's length, ``cu_seqlens[-1]``:
    the gathered tensor's sequence length) is given: it runs in every layer's forward."""
    cu = cu_seqlens.to(torch.long)
    if total is None:
        total = int(cu[-1])  # a host read: callers on the hot path pass the total they know
    pos = torch.arange(total, device=cu.device)
    doc = document_ids(cu, total)
    start = cu[doc]
    chunk = (cu[1:] - cu[:-1])[doc] // (2 * ulysses)  # > 0: a token's document is not empty
    j, off = (pos - start) // chunk, (pos - start) % chunk
    owner = torch.minimum(j, 2 * ulysses - 1 - j)
    # within its owner, a token sits after the earlier documents' 2 chunks each (start / P),
    # in the document's first or second chunk
    received = owner * (total // ulysses) + start // ulysses + (j >= ulysses) * chunk + off
    order = torch.empty_like(pos)
    order[received] = pos
    return order


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def _reorders(order: torch.Tensor, sd: int) -> Tuple[Reorder, Reorder]:
    """(received -> natural, natural -> received) for ``order[i]`` = natural position of received token i."""
    inv = _inverse(order)
    return (lambda t: t.index_select(sd, inv)), (lambda t: t.index_select(sd, order))


def held_bytes(token_order: str, seq_len: int) -> int:
    """Bytes of the index tensors :func:`token_orders` keeps for a sequence of ``seq_len`` tokens (an
    order and its inverse, int64, for ``"load_balanced"``; per-document orders are made per call)."""
    return 2 * seq_len * torch.iinfo(torch.long).bits // 8 if token_order == "load_balanced" else 0


def token_orders(
    token_order: str, ulysses: int, seq_len: int, device, sd: int
) -> Optional[Callable[[Optional[torch.Tensor]], Tuple[Reorder, Reorder]]]:
    """``None`` when the received order is natural; else ``orders(cu_seqlens)`` ->
    ``(to_natural, to_received)`` reorderings of the sequence dim ``sd`` of the gathered tensors."""
    if token_order == "load_balanced":
        n = seq_len // (2 * ulysses)
        chunk_of = torch.tensor(load_balanced_permutation(ulysses), dtype=torch.long, device=device)
        order = (chunk_of[:, None] * n + torch.arange(n, device=device)).reshape(-1)
        fixed = _reorders(order, sd)
        return lambda cu: fixed
    if token_order == "per_document":
        return lambda cu: _reorders(per_document_order(cu.to(device), ulysses, seq_len), sd)
    return None
