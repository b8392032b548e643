"""The exchange (ulysses_mcore.exchange): the two layout transforms on random shapes (hypothesis),
against single-rank references (tests/helpers.py), and the head plan."""

import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from ulysses_mcore import exchange as comm
from tests.helpers import reference_seq_to_head, run_threaded, shard_tokens


@st.composite
def shapes(draw):
    P = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8, 16) if h % P == 0 or P % h == 0]))
    group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if (kv * g) % P == 0]))
    s_local = draw(st.integers(1, 4))
    b = draw(st.integers(1, 3))
    d = draw(st.integers(1, 9))
    layout = draw(st.sampled_from(comm.LAYOUTS))
    return P, kv * group, kv, s_local * P, b, d, layout


@settings(max_examples=30, deadline=None)
@given(shapes())
def test_seq_to_head_then_back_is_identity(shape):
    P, hq, hk, S, b, d, layout = shape
    plan = comm.HeadPlan(hq, hk, P)
    assert comm.is_even(hq, hk, P)
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    mk = lambda h: torch.randn((S, b, h, d) if layout == "sbhd" else (b, S, h, d), generator=g)
    q, k, v = mk(hq), mk(hk), mk(hk)

    def rank_fn(rank, world):
        grp = dist.group.WORLD
        qs, ks, vs = (shard_tokens(t, rank, world, layout).clone().requires_grad_() for t in (q, k, v))
        qh, kh, vh = comm.seq_to_head(qs, ks, vs, grp, plan, layout)
        # the head-sharded tensors are exactly the reference's heads of this rank
        torch.testing.assert_close(qh, reference_seq_to_head(q, rank, plan, "q", layout), rtol=0, atol=0)
        torch.testing.assert_close(kh, reference_seq_to_head(k, rank, plan, "kv", layout), rtol=0, atol=0)
        torch.testing.assert_close(vh, reference_seq_to_head(v, rank, plan, "kv", layout), rtol=0, atol=0)
        back = comm.head_to_seq(qh, grp, plan, layout)
        torch.testing.assert_close(back, qs, rtol=0, atol=0)
        # backward: d(back)/d(qs) is the identity; k and v gradients count their replicas
        (back.sum() + kh.sum() + 2 * vh.sum()).backward()
        torch.testing.assert_close(qs.grad, torch.ones_like(qs), rtol=0, atol=0)
        torch.testing.assert_close(ks.grad, torch.full_like(ks, plan.kv_replicas), rtol=0, atol=0)
        torch.testing.assert_close(vs.grad, torch.full_like(vs, 2.0 * plan.kv_replicas), rtol=0, atol=0)

    if P == 1:
        # degree 1 is the identity with no collective
        plan1 = comm.HeadPlan(hq, hk, 1)
        assert comm.seq_to_head(q, k, v, None, plan1, layout)[0] is q
        return
    run_threaded(P, rank_fn)


def test_heads_of_a_kv_group_stay_together():
    # 8 query heads, 2 kv heads, P = 4: ranks 0-1 hold query heads 0-3 (kv head 0), ranks 2-3 heads 4-7 (kv 1)
    plan = comm.HeadPlan(8, 2, 4)
    assert [plan.kv_heads_of_rank(r) for r in range(4)] == [[0], [0], [1], [1]]
    assert plan.kv_replicas == 2 and plan.kv_count(0) == 1
    plan = comm.HeadPlan(16, 8, 4)
    assert [plan.kv_heads_of_rank(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_buffer_pool_stays_within_its_bytes_over_hundreds_of_shapes():
    """300 distinct sequence lengths through the exchange (each call's buffers are 0.3-0.6 MB): the
    pool keeps at most its max_bytes per thread and the process does not grow with the shapes
    (unbounded, it kept every shape's buffers: 120 shapes grew a rank by 1.6 GB)."""
    import resource

    from ulysses_mcore import ulysses_attention
    from ulysses_mcore.exchange import POOL

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def fn(rank, world):
        POOL.max_bytes = 8 << 20
        worst, seen = 0, 0
        for i in range(300):
            s = 2 * (1024 + 8 * i)  # tokens: buffers of [s/2, 1, 8 heads, 16] fp32 and up
            q, k, v = (torch.randn(s // world, 1, 8, 16) for _ in range(3))
            ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True, check=False)
            worst, seen = max(worst, POOL.held), seen + 3 * q.numel() * 4
        held = POOL.held
        POOL.clear()
        return worst, held, seen

    before = rss_mb()
    res = run_threaded(2, fn)
    grown = rss_mb() - before
    for worst, held, seen in res:
        assert worst <= 8 << 20 and held <= 8 << 20
        assert seen > 500 << 20  # what an unbounded pool would have kept, per thread
    assert grown < 150, grown


def test_size_classes_are_powers_of_two():
    from ulysses_mcore.exchange import size_class

    assert all(n <= size_class(n) < 2 * n for n in range(1, 200_000, 37))
    assert {size_class(n) for n in range(70_000, 260_000)} == {1 << 17, 1 << 18}
