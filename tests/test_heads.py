"""The head plan (ulysses_mcore.exchange.heads): which heads each rank computes, kv groups kept whole, and
the reasons a head count does not fit."""

import pytest

from ulysses_mcore.exchange.heads import HeadPlan, head_layout_error, is_even, overlap_error


def test_heads_of_a_kv_group_stay_together():
    # 8 query heads, 2 kv heads, P = 4: ranks 0-1 hold query heads 0-3 (kv head 0), ranks 2-3 heads 4-7 (kv 1)
    plan = HeadPlan(8, 2, 4)
    assert [plan.kv_heads_of_rank(r) for r in range(4)] == [[0], [0], [1], [1]]
    assert plan.kv_replicas == 2 and plan.kv_count(0) == 1
    plan = HeadPlan(16, 8, 4)
    assert [plan.kv_heads_of_rank(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("hq, ulysses", [(7, 4), (12, 8), (5, 2), (32, 8)])
def test_every_query_head_has_exactly_one_rank_and_counts_differ_by_at_most_one(hq, ulysses):
    plan = HeadPlan(hq, hq, ulysses)
    ranges = [plan.q_range(r) for r in range(ulysses)]
    assert [h for lo, hi in ranges for h in range(lo, hi)] == list(range(hq))
    counts = [hi - lo for lo, hi in ranges]
    assert max(counts) - min(counts) <= (0 if hq % ulysses == 0 else 1)
    assert is_even(hq, hq, ulysses) == (hq % ulysses == 0)


def test_misfits_are_explained():
    assert "at least one head" in head_layout_error(4, 4, 8)
    assert "multiple of kv heads" in head_layout_error(6, 4, 2)
    assert head_layout_error(8, 2, 4) is None
    assert "overlap_chunks=3 must divide the 4 query" in overlap_error(8, 8, 2, 3)
    assert overlap_error(8, 8, 2, 2) is None
