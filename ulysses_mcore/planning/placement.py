"""A Ulysses degree per document: where each document of a global batch runs (``--dynamic-ulysses``).

Pure arithmetic over document lengths -- no torch, no Megatron -- so the trainer's scheduler is
tested alone.  The ``R`` ranks that share a tensor-parallel rank (data-parallel x Ulysses) run the
global batch as ``slots`` (micro-batches).  In a slot every rank belongs to exactly one *cell*: an
aligned block of ``d`` ranks (``d`` a power of two up to the largest degree ``U``; blocks
``[k d, (k + 1) d)``, so the groups are built once at start-up) that holds some documents, or a
rank idle in that slot.  A cell's documents are concatenated into one packed stream, padded with
one loss-masked pad document to ``d x per_rank`` tokens, and split contiguously: rank ``j`` of the
block holds tokens ``[j per_rank, (j + 1) per_rank)`` and attention runs per document after the
all-to-all, exactly as at a fixed degree.

Placement (:func:`place`):

1. each document gets the smallest degree ``d`` whose share ``ceil(L / d)`` fits the per-rank load
   ``cap = micro-batch-size x seq-length / U`` (so no rank ever holds more tokens than at the fixed
   degree ``U``); a document that does not fit at ``U`` is refused (:class:`PlacementError`);
2. documents of degree ``d > 1`` are packed first-fit-decreasing into cells of degree ``d`` (at most
   ``cap`` tokens a rank, padding included);
3. cells, most work first, go to the (slot, block) whose ranks have the least work so far, among
   blocks free in that slot (a new slot when none is free);
4. whole documents (degree 1), longest first, go to the (slot, rank) with room whose rank has the
   least work so far (a new slot when none has room).

Work is the cost model's (:class:`Costs`): per token (the MLP, projections, logits), per document
the attention's causal pairs, and the all-to-all bytes of an exchanged document -- per rank,
divided by the cell's degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


class PlacementError(ValueError):
    """A document that no degree up to the largest fits (raised alike on every rank)."""


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of work on one rank: ``token`` per token (linear layers, logits, norms),
    ``pair`` per causal (query, key) pair of a document (attention), ``exchanged`` per token an
    all-to-all moves off the rank (``(d - 1) / d`` of a cell's tokens), ``cell`` per micro-batch."""

    token: float = 1.0
    pair: float = 0.0
    exchanged: float = 0.0
    cell: float = 0.0

    @classmethod
    def of_model(cls, model: Dict, *, gemm_flops: float, attn_flops: float, bytes_per_s: float, dtype_bytes: int = 4):
        """From a model's sizes (:data:`ulysses_mcore.planning.step_time.MODELS` keys) and the rates
        of a device: FLOPs of a forward + backward (x3), the all-to-all's four tensors (q, k, v, out;
        k and v with their kv heads) forward and backward."""
        h, layers, ffn = model["hidden_size"], model["num_layers"], model["ffn_hidden_size"]
        heads, groups = model["num_attention_heads"], model.get("num_query_groups") or model["num_attention_heads"]
        kv = h * groups // heads
        mlp = (3 if model.get("swiglu") else 2) * h * ffn
        linear = 6 * layers * (h * (h + 2 * kv) + h * h + mlp) + 6 * h * model["vocab_size"]
        attention = 3 * 4 * h * layers  # q.k and p.v, a pair, every head; x3 for the backward
        moved = 2 * (2 * h + 2 * kv) * dtype_bytes * layers  # forward + backward
        return cls(token=linear / gemm_flops, pair=attention / attn_flops, exchanged=moved / bytes_per_s)

    def document(self, length: int, degree: int) -> float:
        """One rank's share of a document's work at ``degree``."""
        pairs = length * (length + 1) / 2
        work = self.token * length + self.pair * pairs
        return (work + (self.exchanged * length * (degree - 1) / degree if degree > 1 else 0.0)) / degree


@dataclass(frozen=True)
class Cell:
    """Documents ``docs`` run on the ranks ``first .. first + degree - 1`` in slot ``slot``; each of
    them holds ``per_rank`` tokens (the cell's ``tokens`` plus pad, split contiguously)."""

    slot: int
    first: int
    degree: int
    docs: Tuple[int, ...]
    tokens: int
    per_rank: int

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.degree)

    @property
    def pad(self) -> int:
        return self.per_rank * self.degree - self.tokens


@dataclass
class Schedule:
    """Where every document of a global batch runs: ``cells`` over ``slots`` x ``ranks``."""

    ranks: int
    slots: int
    cells: List[Cell]
    degrees: List[int]
    work: List[float] = field(default_factory=list)

    def cells_of(self, rank: int) -> List[Cell]:
        """The cells rank ``rank`` runs, in slot order (a rank idle in a slot has none there)."""
        return sorted((c for c in self.cells if rank in c.ranks), key=lambda c: c.slot)

    def grid(self) -> List[List[Optional[Cell]]]:
        """``[slot][rank]`` -> the cell that rank is in during that slot, or ``None`` (idle)."""
        g: List[List[Optional[Cell]]] = [[None] * self.ranks for _ in range(self.slots)]
        for c in self.cells:
            for r in c.ranks:
                g[c.slot][r] = c
        return g

    def exchanged_tokens(self) -> int:
        """Tokens (pad included) that run on a cell of degree > 1: what the all-to-alls move."""
        return sum(c.per_rank * c.degree for c in self.cells if c.degree > 1)


def degree_for(length: int, cap: int, max_degree: int) -> int:
    """The smallest power-of-two degree whose share ``ceil(length / d)`` fits ``cap`` tokens a rank."""
    d = 1
    while d <= max_degree:
        if math.ceil(length / d) <= cap:
            return d
        d *= 2
    need = _pow2_at_least(math.ceil(length / cap))
    raise PlacementError(
        f"a document of {length} tokens does not fit: at --ulysses-degree {max_degree} each rank would hold "
        f"{math.ceil(length / max_degree)} of its tokens, more than the per-rank load {cap} "
        f"(--micro-batch-size x --seq-length / --ulysses-degree); fit it with --ulysses-degree {need} "
        f"(the heads allowing) or a larger --micro-batch-size x --seq-length"
    )


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _per_rank(tokens: int, degree: int, cap: int, bucket: int) -> int:
    return min(cap, _round_up(math.ceil(tokens / degree), bucket)) if degree > 1 else tokens


def _pack_cells(lengths, docs: List[int], degree: int, cap: int) -> List[List[int]]:
    """First-fit decreasing of documents of one degree into cells of ``degree x cap`` tokens."""
    bins: List[List[int]] = []
    room: List[int] = []
    for i in sorted(docs, key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if math.ceil((degree * cap - free + lengths[i]) / degree) <= cap:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(degree * cap - lengths[i])
    return bins


class _Board:
    """The slots being filled: which ranks a cell holds in each slot, each rank's work and, for
    whole documents, each (slot, rank)'s room left."""

    def __init__(self, ranks: int, cap: int):
        self.ranks, self.cap = ranks, cap
        self.busy: List[List[bool]] = []  # [slot][rank] held by a cell of degree > 1
        self.room: List[List[int]] = []  # [slot][rank] tokens left for whole documents
        self.work = [0.0] * ranks

    def new_slot(self) -> int:
        self.busy.append([False] * self.ranks)
        self.room.append([self.cap] * self.ranks)
        return len(self.busy) - 1

    def free_block(self, degree: int) -> Tuple[int, int]:
        """(slot, first rank) of the free aligned block whose busiest rank has the least work."""
        best = None
        for s in range(len(self.busy)):
            for first in range(0, self.ranks, degree):
                block = range(first, first + degree)
                if any(self.busy[s][r] for r in block):
                    continue
                key = (max(self.work[r] for r in block), s)
                if best is None or key < best[0]:
                    best = (key, s, first)
        if best is None:
            return self.new_slot(), self._least_loaded_block(degree)
        return best[1], best[2]

    def _least_loaded_block(self, degree: int) -> int:
        return min(range(0, self.ranks, degree), key=lambda f: max(self.work[f : f + degree]))

    def room_for(self, length: int) -> Tuple[int, int]:
        """(slot, rank) with room for a whole document whose rank has the least work."""
        best = None
        for s in range(len(self.busy)):
            for r in range(self.ranks):
                if not self.busy[s][r] and self.room[s][r] >= length:
                    key = (self.work[r], s)
                    if best is None or key < best[0]:
                        best = (key, s, r)
        if best is None:
            s = self.new_slot()
            return s, min(range(self.ranks), key=lambda r: self.work[r])
        return best[1], best[2]


def place(
    lengths: Sequence[int],
    *,
    ranks: int,
    max_degree: int,
    cap: int,
    costs: Costs = Costs(),
    bucket: int = 1,
) -> Schedule:
    """The placement of documents of ``lengths`` on ``ranks`` ranks (a multiple of ``max_degree``,
    a power of two), at most ``cap`` tokens a rank in a slot; the per-rank length of a cell of
    degree > 1 is rounded up to a multiple of ``bucket`` (never past ``cap``) so a run sees few
    shapes.  Deterministic: every rank computes the same schedule from the same lengths."""
    _check(ranks, max_degree, cap, bucket)
    degrees = [degree_for(L, cap, max_degree) for L in lengths]
    board, cells = _Board(ranks, cap), []
    groups = []  # (work a rank, degree, docs)
    d = max_degree
    while d > 1:
        for docs in _pack_cells(lengths, [i for i, g in enumerate(degrees) if g == d], d, cap):
            groups.append((sum(costs.document(lengths[i], d) for i in docs) + costs.cell, d, docs))
        d //= 2
    for work, degree, docs in sorted(groups, key=lambda g: (-g[0], -g[1], g[2])):
        slot, first = board.free_block(degree)
        tokens = sum(lengths[i] for i in docs)
        for r in range(first, first + degree):
            board.busy[slot][r] = True
            board.work[r] += work
        cells.append(Cell(slot, first, degree, tuple(sorted(docs)), tokens, _per_rank(tokens, degree, cap, bucket)))
    whole: Dict[Tuple[int, int], List[int]] = {}
    for i in sorted((i for i, g in enumerate(degrees) if g == 1), key=lambda i: (-lengths[i], i)):
        slot, r = board.room_for(lengths[i])
        if (slot, r) not in whole:
            board.work[r] += costs.cell
        whole.setdefault((slot, r), []).append(i)
        board.room[slot][r] -= lengths[i]
        board.work[r] += costs.document(lengths[i], 1)
    for (slot, r), docs in sorted(whole.items()):
        tokens = sum(lengths[i] for i in docs)
        cells.append(Cell(slot, r, 1, tuple(sorted(docs)), tokens, tokens))
    cells.sort(key=lambda c: (c.slot, c.first))
    return Schedule(ranks, len(board.busy), cells, degrees, board.work)


def _check(ranks: int, max_degree: int, cap: int, bucket: int) -> None:
    if max_degree < 1 or max_degree & (max_degree - 1):
        raise ValueError(f"--dynamic-ulysses needs --ulysses-degree a power of two, not {max_degree}")
    if ranks % max_degree:
        raise ValueError(f"{ranks} data-parallel x Ulysses ranks are not a multiple of --ulysses-degree {max_degree}")
    if cap < 1 or bucket < 1:
        raise ValueError(f"the per-rank load ({cap}) and the bucket ({bucket}) must be positive")


__all__ = ["Costs", "Cell", "Schedule", "PlacementError", "degree_for", "place"]
