"""The exchange (ulysses_mcore.exchange.pair): the two layout transforms on random shapes (hypothesis),
against single-rank references (tests/helpers.py)."""

import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from ulysses_mcore.exchange import pair as comm
from ulysses_mcore.exchange.heads import LAYOUTS, HeadPlan, is_even
from tests.helpers import reference_seq_to_head, run_threaded, shard_tokens


@st.composite
def shapes(draw):
    P = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8, 16) if h % P == 0 or P % h == 0]))
    group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if (kv * g) % P == 0]))
    s_local = draw(st.integers(1, 4))
    b = draw(st.integers(1, 3))
    d = draw(st.integers(1, 9))
    layout = draw(st.sampled_from(LAYOUTS))
    return P, kv * group, kv, s_local * P, b, d, layout


@settings(max_examples=30, deadline=None)
@given(shapes())
def test_seq_to_head_then_back_is_identity(shape):
    P, hq, hk, S, b, d, layout = shape
    plan = HeadPlan(hq, hk, P)
    assert is_even(hq, hk, P)
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
        plan1 = HeadPlan(hq, hk, 1)
        assert comm.seq_to_head(q, k, v, None, plan1, layout)[0] is q
        return
    run_threaded(P, rank_fn)
