"""The routes (ulysses_mcore.exchange.routes): a route worked out once carries uneven head plans (7 heads
over 4 ranks, kv groups straddling ranks) and its output back, exactly, in both layouts."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import reference_seq_to_head, run_threaded, shard_tokens
from ulysses_mcore.exchange.heads import HeadPlan
from ulysses_mcore.exchange.routes import out_route, qkv_route


@pytest.mark.parametrize("hq, hk", [(7, 7), (6, 3), (8, 2)])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_a_route_delivers_each_ranks_heads_and_brings_them_back(hq, hk, layout):
    P, S, b, d = 4, 8, 2, 5
    g = torch.Generator().manual_seed(hq * 10 + hk)
    mk = lambda h: torch.randn((S, b, h, d) if layout == "sbhd" else (b, S, h, d), generator=g)
    q, k, v = mk(hq), mk(hk), mk(hk)
    plan = HeadPlan(hq, hk, P)

    def fn(rank, world):
        qs, ks, vs = (shard_tokens(t, rank, world, layout) for t in (q, k, v))
        route = qkv_route(qs, vs, plan, rank, layout)
        qh, kh, vh = route.received(route.start(route.pack_all(qs, ks, vs), dist.group.WORLD)[0])
        for got, full, kind in ((qh, q, "q"), (kh, k, "kv"), (vh, v, "kv")):
            torch.testing.assert_close(got, reference_seq_to_head(full, rank, plan, kind, layout), rtol=0, atol=0)
        back = out_route(qs.shape, d, plan, rank, layout)
        out = back.finish(back.start(qh.contiguous(), dist.group.WORLD)[0])
        torch.testing.assert_close(out, qs, rtol=0, atol=0)

    run_threaded(P, fn)
