"""Which heads go where: a :class:`HeadPlan` gives, per destination rank of a Ulysses group, its
query heads (an even split, or the first ``h % P`` ranks one more) and the kv heads they use;
:func:`head_layout_error` / :func:`overlap_error` say why a head count does not fit.  Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple

LAYOUTS = ("sbhd", "bshd")


def seq_dim(layout: str) -> int:
    """The sequence dim of a 4-D tensor in ``layout`` (``thd`` runs as ``sbhd`` with b = 1)."""
    return 1 if layout == "bshd" else 0


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class HeadPlan:
    """Which heads go to which rank, for ``num_q_heads`` / ``num_kv_heads`` over ``ulysses`` ranks."""

    num_q_heads: int
    num_kv_heads: int
    ulysses: int

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def q_range(self, rank: int) -> Tuple[int, int]:
        base, extra = divmod(self.num_q_heads, self.ulysses)
        first = rank * base + min(rank, extra)
        return first, first + base + (1 if rank < extra else 0)

    def kv_range(self, rank: int) -> Tuple[int, int]:
        lo, hi = self.q_range(rank)
        return lo // self.group_size, (hi - 1) // self.group_size + 1

    def q_count(self, rank: int) -> int:
        lo, hi = self.q_range(rank)
        return hi - lo

    def kv_count(self, rank: int) -> int:
        lo, hi = self.kv_range(rank)
        return hi - lo

    def chunk_heads(self, rank: int) -> int:
        return self.q_count(rank) + 2 * self.kv_count(rank)

    @cached_property
    def regular(self) -> bool:
        """Every rank the same number of query heads and either ``kv/P`` kv heads each (scatter)
        or one kv head shared by ``P/kv`` consecutive ranks (replication): packed in one strided
        copy per tensor."""
        hq, hk, ulysses = self.num_q_heads, self.num_kv_heads, self.ulysses
        return hq % ulysses == 0 and (hk % ulysses == 0 or ulysses % hk == 0)

    @cached_property
    def uniform(self) -> bool:
        """All split sizes equal: the all-to-all needs no split sizes."""
        return len({(self.q_count(j), self.kv_count(j)) for j in range(self.ulysses)}) == 1

    @property
    def kv_replicas(self) -> int:
        """Regular plans: how many consecutive ranks receive the same kv head (1 = scatter)."""
        return self.ulysses // self.num_kv_heads if self.num_kv_heads < self.ulysses else 1

    def kv_index_for_q(self, rank: int) -> Optional[List[int]]:
        """Local kv head of each local query head when the local heads are not an ordinary GQA
        layout (a rank's query heads start inside a kv group), else ``None``."""
        lo, hi = self.q_range(rank)
        g, nkv = self.group_size, self.kv_count(rank)
        if nkv == 1 or (lo % g == 0 and (hi - lo) % g == 0):
            return None
        return [q // g - lo // g for q in range(lo, hi)]

    def kv_heads_of_rank(self, rank: int) -> List[int]:
        return list(range(*self.kv_range(rank)))


def head_layout_error(num_q_heads: int, num_kv_heads: int, ulysses: int) -> Optional[str]:
    """Why no head plan fits, or ``None``."""
    if num_q_heads < 1 or num_kv_heads < 1:
        return f"head counts must be >= 1 (query heads={num_q_heads}, kv heads={num_kv_heads})"
    if num_q_heads % num_kv_heads:
        return (
            f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) for grouped-query attention"
        )
    if num_q_heads < ulysses:
        return (
            f"ulysses degree {ulysses} is larger than the {num_q_heads} query heads on this tensor-parallel "
            f"rank: every rank needs at least one head; use a degree <= {num_q_heads} "
            "(ring context parallelism covers larger degrees)"
        )
    return None


def is_even(num_q_heads: int, num_kv_heads: int, ulysses: int) -> bool:
    return (
        head_layout_error(num_q_heads, num_kv_heads, ulysses) is None
        and HeadPlan(num_q_heads, num_kv_heads, ulysses).regular
    )


def overlap_error(num_q_heads: int, num_kv_heads: int, ulysses: int, chunks) -> Optional[str]:
    """Why ``chunks`` head chunks cannot be pipelined (:mod:`ulysses_mcore.exchange.overlap`), or ``None``."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"overlap_chunks must be an integer >= 1, got {chunks!r}"
    if chunks == 1:
        return None
    plan = HeadPlan(num_q_heads, num_kv_heads, ulysses)
    q, kv = num_q_heads // ulysses, max(num_kv_heads // ulysses, 1)
    if q % chunks or plan.kv_replicas > 1 or kv % chunks:
        return (
            f"overlap_chunks={chunks} must divide the {q} query and {kv} kv heads each rank computes "
            f"(kv heads replicated x{plan.kv_replicas}); use overlap_chunks=1"
        )
    return None
