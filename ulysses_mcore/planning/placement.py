"""A Ulysses degree per document: where each document of a global batch runs (``--dynamic-ulysses``).

Pure arithmetic over document lengths -- no torch, no Megatron -- so the trainer's scheduler is
tested alone.  The ``R`` ranks that share a tensor-parallel rank (data-parallel x Ulysses) run the
global batch as micro-batches (*slots*); in each slot a rank is in exactly one *cell*: an aligned
block of ``d`` ranks (``d`` a power of two up to the largest degree ``U``; blocks ``[k d, (k + 1)
d)``, so the groups are built once at start-up) holding some documents.  A cell's documents are
concatenated into one packed stream, padded with one loss-masked pad document to ``d x per_rank``
tokens, and split contiguously: rank ``j`` of the block holds tokens ``[j per_rank, (j + 1)
per_rank)``, and attention runs per document after the all-to-all, exactly as at a fixed degree.

Placement (:func:`place`), a list schedule over the cost model's clock of each rank:

1. each document gets the smallest degree ``d`` whose share ``ceil(L / d)`` fits the per-rank load
   ``cap = micro-batch-size x seq-length / U`` (so no rank ever holds more tokens than at the fixed
   degree ``U``); a document that does not fit at ``U`` is refused (:class:`PlacementError`);
2. documents of degree ``d > 1`` are packed first-fit-decreasing into cells of degree ``d`` (at most
   ``cap`` tokens a rank, padding included), highest degree first; a document joins a cell of a
   higher degree when it has room (exchanged either way; a cell less is a micro-batch less);
3. those cells, largest degree first and then most work first, each go to the aligned block that is
   free first (its members run them in this one global order: no two groups wait on each other);
4. whole documents (degree 1), longest first, each go where they end first on the cost model's
   clock: into a micro-batch of a rank with room (first fit), or a new one, which costs a micro-batch's
   own time; each rank runs as many micro-batches as its documents need (Megatron's schedule takes a
   count per rank, so none is split to match its peers).

Work is the cost model's (:class:`Costs`, from a calibration's rates): per token (the MLP,
projections, logits), per document the attention's causal pairs, and the all-to-all bytes of an
exchanged document -- per rank, divided by the cell's degree -- plus each micro-batch's own time
and a cell's pad tokens.  The objective is the busiest rank's finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .shape import ModelShape


class PlacementError(ValueError):
    """A document that no degree up to the largest fits (raised alike on every rank)."""


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of work on one rank: ``token`` per token (linear layers, logits, norms),
    ``pair`` per causal (query, key) pair of a document (attention), ``exchanged`` per token an
    all-to-all moves off the rank (``(d - 1) / d`` of a cell's tokens) inside a node,
    ``exchanged_inter`` the same across nodes (a cell of more ranks than ``gpus_per_node``: aligned
    blocks of a power-of-two degree span nodes exactly then), ``cell`` per micro-batch (host work per
    layer, the micro-batch's own), ``messages`` per micro-batch with an exchange (its all-to-alls'
    latency)."""

    token: float = 1.0
    pair: float = 0.0
    exchanged: float = 0.0
    cell: float = 0.0
    messages: float = 0.0
    exchanged_inter: Optional[float] = None  # None: as inside a node
    gpus_per_node: Optional[int] = None  # None: one node holds every rank

    @classmethod
    def from_rates(
        cls,
        rates: Dict[str, Dict[str, float]],
        model: ModelShape,
        *,
        dtype_bytes: int = 4,
        gpus_per_node: Optional[int] = None,
    ):
        """From the step-time model's rates (a calibration's ``"rates"``, ``ulysses-mcore fit``, or
        :func:`ulysses_mcore.planning.step_time.gpu_rates` of a preset): the same phases and the same
        counts (:meth:`ModelShape.work`), per document; 3 passes (forward, backward twice)."""
        w, layers = model.work(), model.num_layers
        attn, mlp, rest, a2a = (rates.get(p, {}) for p in ("attention", "mlp", "rest", "a2a"))
        calls = sum(r.get("layer_calls", 0.0) for r in (attn, mlp, rest))
        moved = 2 * w["exchanged"] * layers * dtype_bytes  # forward and backward
        return cls(
            token=3 * layers * (mlp.get("mlp_flops", 0.0) * w["mlp"] + rest.get("other_flops", 0.0) * w["projections"])
            + 3 * rest.get("other_flops", 0.0) * w["logits"]
            + 3 * layers * (rest.get("tokens", 0.0) + attn.get("attn_rows", 0.0) * model.num_attention_heads),
            pair=3 * layers * attn.get("attn_flops", 0.0) * w["attention"],
            exchanged=a2a.get("a2a_bytes_intra", 0.0) * moved,
            exchanged_inter=a2a.get("a2a_bytes_inter", a2a.get("a2a_bytes_intra", 0.0)) * moved,
            cell=calls * layers + rest.get("micro_batches", 0.0),
            messages=a2a.get("a2a_msgs", 0.0) * 4 * layers,
            gpus_per_node=gpus_per_node,
        )

    def document(self, length: int, ulysses: int) -> float:
        """One rank's share of a document's work at ``ulysses``."""
        pairs = length * (length + 1) / 2
        work = self.token * length + self.pair * pairs
        if ulysses > 1:
            across = self.gpus_per_node is not None and ulysses > self.gpus_per_node
            rate = self.exchanged_inter if across and self.exchanged_inter is not None else self.exchanged
            work += rate * length * (ulysses - 1) / ulysses
        return work / ulysses


@dataclass(frozen=True)
class Cell:
    """Documents ``docs`` run on the ranks ``first .. first + degree - 1``; each of them holds
    ``per_rank`` tokens (the cell's ``tokens`` plus pad, split contiguously).  ``order``: cells of
    degree > 1 in the one order every member runs them in (-1 for a rank's whole documents)."""

    order: int
    first: int
    ulysses: int
    docs: Tuple[int, ...]
    tokens: int
    per_rank: int

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.ulysses)

    @property
    def pad(self) -> int:
        return self.per_rank * self.ulysses - self.tokens


@dataclass
class Schedule:
    """Where every document of a global batch runs: ``per_rank[r]`` is rank ``r``'s micro-batches
    (slots) in the order it runs them -- its cells of degree > 1 in their global order, then its
    whole documents.  ``finish``: the cost model's time each rank ends (waits included), ``work``:
    its busy time."""

    ranks: int
    per_rank: List[List[Cell]]
    degrees: List[int]
    finish: List[float] = field(default_factory=list)
    work: List[float] = field(default_factory=list)

    @property
    def slots(self) -> int:
        return max((len(c) for c in self.per_rank), default=0)

    def cells_of(self, rank: int) -> List[Cell]:
        return self.per_rank[rank]

    def cells(self) -> List[Cell]:
        """Every cell once."""
        seen, out = set(), []
        for cells in self.per_rank:
            for c in cells:
                if id(c) not in seen:
                    seen.add(id(c))
                    out.append(c)
        return out

    def exchanged_tokens(self) -> int:
        """Tokens (pad included) that run on a cell of degree > 1: what the all-to-alls move."""
        return sum(c.per_rank * c.ulysses for c in self.cells() if c.ulysses > 1)


def degree_for(length: int, cap: int, max_ulysses: int) -> int:
    """The smallest power-of-two degree whose share ``ceil(length / d)`` fits ``cap`` tokens a rank."""
    d = 1
    while d <= max_ulysses:
        if math.ceil(length / d) <= cap:
            return d
        d *= 2
    need = _pow2_at_least(math.ceil(length / cap))
    raise PlacementError(
        f"a document of {length} tokens does not fit: at --ulysses-degree {max_ulysses} each rank would hold "
        f"{math.ceil(length / max_ulysses)} of its tokens, more than the per-rank load {cap} "
        f"(--micro-batch-size x --seq-length / --ulysses-degree); fit it with --ulysses-degree {need} "
        f"(the heads allowing) or a larger --micro-batch-size x --seq-length"
    )


def powers_of_two(n: int):
    """2, 4, ... up to ``n``: the degrees a dynamic placement may use above 1."""
    d = 2
    while d <= n:
        yield d
        d *= 2


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _per_rank(tokens: int, ulysses: int, cap: int, bucket: int) -> int:
    """A rank's tokens of a cell: its share rounded up to the bucket, never past the load."""
    return min(cap, _round_up(math.ceil(tokens / ulysses), bucket))


def _pack_cells(lengths, degrees: List[int], cap: int) -> List[List]:
    """First-fit decreasing of the documents of degree > 1 into cells ``[degree, tokens, docs]`` of at
    most ``degree x cap`` tokens, highest degree first: a document may join a cell of a higher degree
    that has room (it is exchanged either way, and one cell is one micro-batch less)."""
    cells: List[List] = []
    for i in sorted((i for i, g in enumerate(degrees) if g > 1), key=lambda i: (-degrees[i], -lengths[i], i)):
        for c in cells:
            if c[0] >= degrees[i] and math.ceil((c[1] + lengths[i]) / c[0]) <= cap:
                c[1] += lengths[i]
                c[2].append(i)
                break
        else:
            cells.append([degrees[i], lengths[i], [i]])
    return cells


def place(
    lengths: Sequence[int],
    *,
    ranks: int,
    max_ulysses: int,
    cap: int,
    costs: Costs = Costs(),
    bucket: int = 1,
    whole_bucket: int = 1,
) -> Schedule:
    """The placement of documents of ``lengths`` on ``ranks`` ranks (a multiple of ``max_ulysses``,
    a power of two), at most ``cap`` tokens a rank in a micro-batch; the per-rank length of every
    cell of degree > 1 is rounded up to a multiple of ``bucket`` (never past ``cap``) so a run sees
    few exchanged shapes (prepared calls and exchange buffers stay few); a micro-batch of whole
    documents, which exchanges nothing, only to ``whole_bucket`` (sequence parallelism's multiple of
    the tensor-parallel size).  Deterministic: every rank computes the same schedule from the same
    lengths."""
    _check(ranks, max_ulysses, cap, min(bucket, whole_bucket))
    degrees = [degree_for(L, cap, max_ulysses) for L in lengths]
    clock, busy = [0.0] * ranks, [0.0] * ranks
    per_rank: List[List[Cell]] = [[] for _ in range(ranks)]
    for order, (work, d, docs) in enumerate(_group_cells(lengths, degrees, cap, costs, bucket)):
        first = min(range(0, ranks, d), key=lambda f: (max(clock[f : f + d]), f))  # the block free first
        end = max(clock[first : first + d]) + work
        tokens = sum(lengths[i] for i in docs)
        cell = Cell(
            order, first, d, docs=tuple(sorted(docs)), tokens=tokens, per_rank=_per_rank(tokens, d, cap, bucket)
        )
        for r in cell.ranks:
            clock[r], busy[r] = end, busy[r] + work
            per_rank[r].append(cell)
    for r, bins in enumerate(_whole_micro_batches(lengths, degrees, cap, costs, (clock, busy, per_rank))):
        for docs in bins:
            tokens = sum(lengths[i] for i in docs)
            per_rank_tokens = _per_rank(tokens, 1, cap, whole_bucket)
            per_rank[r].append(Cell(-1, r, 1, docs=tuple(sorted(docs)), tokens=tokens, per_rank=per_rank_tokens))
    return Schedule(ranks, per_rank, degrees, clock, busy)


def _whole_micro_batches(lengths, degrees, cap: int, costs: Costs, ranks):
    """``ranks = (clock, busy, cells)``: every rank's clock and busy time (advanced here) and its cells
    so far.  Each rank's micro-batches of whole documents (degree 1), every rank as many as its documents
    need (Megatron's schedule takes a count per rank: none is split to match its peers).  Longest
    first, each document goes where it ends first on the cost model's clock -- into a micro-batch of
    that rank with room (first fit), or a new one, which costs the micro-batch's own time (``cell``)."""
    clock, busy, cells = ranks
    bins: List[List[List[int]]] = [[] for _ in clock]
    room: List[List[int]] = [[] for _ in clock]
    first_free = [not mine for mine in cells]  # a rank without a group cell runs one micro-batch regardless:
    for r, free in enumerate(first_free):  # its own time is paid up front, and its first costs no more
        clock[r] += costs.cell if free else 0.0
    for i in sorted((i for i, g in enumerate(degrees) if g == 1), key=lambda i: (-lengths[i], i)):
        work, n = costs.document(lengths[i], 1), lengths[i]
        _, r = min((clock[r] + work + _opening(room[r], n, first_free[r], costs), r) for r in range(len(clock)))
        b = next((b for b, free in enumerate(room[r]) if free >= lengths[i]), None)
        if b is None:
            bins[r].append([])
            room[r].append(cap)
            b = len(bins[r]) - 1
            clock[r] += 0.0 if first_free[r] else costs.cell
            first_free[r] = False
        bins[r][b].append(i)
        room[r][b] -= lengths[i]
        clock[r], busy[r] = clock[r] + work, busy[r] + work
    return bins


def _opening(room: List[int], n: int, first_free: bool, costs: Costs) -> float:
    """What a document of ``n`` tokens adds beyond its work on a rank: nothing where a micro-batch
    of it has room (or its first is still to come), else a new micro-batch's own time."""
    return 0.0 if first_free or any(free >= n for free in room) else costs.cell


def _group_cells(lengths, degrees, cap: int, costs: Costs, bucket: int):
    """(work a rank, degree, documents) of every cell of degree > 1, largest degree first, then most
    work; each document's entry in ``degrees`` becomes the degree it runs at (its cell's).  A cell's
    work counts its pad tokens (its share rounded up to the bucket) and its micro-batch's own time."""
    out = []
    for d, tokens, docs in _pack_cells(lengths, degrees, cap):
        for i in docs:
            degrees[i] = d
        pad = _per_rank(tokens, d, cap, bucket) - tokens / d  # per rank
        work = sum(costs.document(lengths[i], d) for i in docs) + costs.token * pad + costs.cell + costs.messages
        out.append((work, d, docs))
    return sorted(out, key=lambda g: (-g[1], -g[0], g[2]))


def _check(ranks: int, max_ulysses: int, cap: int, bucket: int) -> None:
    if max_ulysses < 1 or max_ulysses & (max_ulysses - 1):
        raise ValueError(f"--dynamic-ulysses needs --ulysses-degree a power of two, not {max_ulysses}")
    if ranks % max_ulysses:
        raise ValueError(f"{ranks} data-parallel x Ulysses ranks are not a multiple of --ulysses-degree {max_ulysses}")
    if cap < 1 or bucket < 1:
        raise ValueError(f"the per-rank load ({cap}) and the bucket ({bucket}) must be positive")


# --------------------------------------------------------------------------- predictions
def samples_of(lengths: Sequence[int], seq: int, count: int) -> List[List[int]]:
    """``count`` samples of ``seq`` tokens cut from the documents of ``lengths`` (each followed by
    its end-of-document token) laid end to end, as Megatron's GPTDataset does; the documents'
    lengths within each sample (a document crossing a sample's end is cut there)."""
    out: List[List[int]] = []
    cur: List[int] = []
    room = seq
    i = 0
    while len(out) < count:
        left = lengths[i % len(lengths)] + 1
        i += 1
        while left:
            take = min(left, room)
            cur.append(take)
            left, room = left - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], seq
                if len(out) == count:
                    break
    return out


def step_times(
    samples: List[List[int]], *, ranks: int, max_ulysses: int, costs: Costs, bucket: int = 1
) -> Dict[str, float]:
    """The cost model's step time (busiest rank) of a global batch ``samples`` on ``ranks`` ranks:
    the fixed degree ``max_ulysses`` (data-parallel groups take contiguous samples), degree 1 (every
    rank whole samples) and the dynamic placement."""
    seq = sum(samples[0])
    dp = ranks // max_ulysses

    def fixed(ulysses: int, groups: int) -> float:
        per = len(samples) // groups
        return max(
            sum(costs.document(L, ulysses) for s in samples[g * per : (g + 1) * per] for L in s) + per * costs.cell
            for g in range(groups)
        )

    schedule = place(
        [L for s in samples for L in s],
        ranks=ranks,
        max_ulysses=max_ulysses,
        cap=seq // max_ulysses,
        costs=costs,
        bucket=bucket,
    )
    return {"fixed": fixed(max_ulysses, dp), "degree 1": fixed(1, ranks), "dynamic": max(schedule.finish)}


__all__ = ["Costs", "Cell", "Schedule", "PlacementError", "degree_for", "place", "samples_of", "step_times"]
