"""The transport (ulysses_mcore.exchange.transport): the exchange's buffer pool stays bounded over many
shapes, and its size classes."""

import torch
import torch.distributed as dist

from tests.helpers import run_threaded


def test_buffer_pool_stays_within_its_bytes_over_hundreds_of_shapes():
    """300 distinct sequence lengths through the exchange (each call's buffers are 0.3-0.6 MB): the
    pool keeps at most its max_bytes per thread and the process does not grow with the shapes
    (unbounded, it kept every shape's buffers: 120 shapes grew a rank by 1.6 GB)."""
    import resource

    from ulysses_mcore import ulysses_attention
    from ulysses_mcore.exchange.transport import POOL

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
    from ulysses_mcore.exchange.transport import size_class

    assert all(n <= size_class(n) < 2 * n for n in range(1, 200_000, 37))
    assert {size_class(n) for n in range(70_000, 260_000)} == {1 << 17, 1 << 18}
