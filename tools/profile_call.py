#!/usr/bin/env python3
"""cProfile of steady-state ``ulysses_attention`` calls on rank 0 of a gloo world: where the host
time of one call goes, forward and backward.

    python tools/profile_call.py --world 2 --calls 300 --top 15

Tiny tensors (8 tokens per rank, 2P heads of 8), as ``tools/bench_overhead.py``: what remains is
host work.  Prints, per mode (``fwd``: no gradient; ``fwd+bwd``), the call count and the
functions with the most own time per call (microseconds per steady-state call; cProfile's own
cost inflates every figure, so read them as shares, the ratios between rows).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ulysses_mcore.devtools.bench import run_world  # noqa: E402


def _profile(fn, calls):
    for _ in range(20):  # warm-up: the first call validates and prepares
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return prof


def _table(prof, calls, top):
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    total = sum(v[2] for v in stats.stats.values())
    lines = [
        f"total {total / calls * 1e6:.0f} us per call (under cProfile)",
        "",
        "| own us / call | calls / call | function |",
        "|---|---|---|",
    ]
    for (path, line, name), (_, ncalls, own, _, _) in rows:
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        lines.append(f"| {own / calls * 1e6:.1f} | {ncalls / calls:g} | `{where}` |")
    return "\n".join(lines)


def _world(rank, world, port, calls, top, queue):
    import torch
    import torch.distributed as dist

    import ulysses_mcore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    q, k, v, dout = (torch.randn(8, 1, 2 * world, 8) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    group = dist.group.WORLD

    def fwd():
        ulysses_mcore.ulysses_attention(q, k, v, group=group, causal=True)

    def fwd_bwd():
        ulysses_mcore.ulysses_attention(*leaves, group=group, causal=True).backward(dout)

    res = {name: _table(_profile(fn, calls), calls, top) for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd))}
    if rank == 0:
        queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    (res,) = run_world(a.world, _world, a.calls, a.top, what="the profile")
    for name, table in res.items():
        print(f"### {name}, P = {a.world}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
