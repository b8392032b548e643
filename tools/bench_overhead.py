#!/usr/bin/env python3
"""Per-call overhead of ``ulysses_attention`` beyond its two all-to-alls and its kernel.

    python tools/bench_overhead.py --degrees 2,4,8 --calls 300

One gloo world of P processes per degree, tiny tensors (the exchange and kernel cost little,
so what remains is the Python/validation overhead).  Steady state: each timing is a median
over ``--calls`` forward calls after warm-up.  Measured in the same world, same shapes:

* ``call``: ``ulysses_attention(q, k, v, group=..., causal=True)`` (forward only);
* ``floor``: two bare ``all_to_all_single`` of exactly the bytes the call exchanges (q, k, v
  packed, then the output) plus the same SDPA kernel on the gathered sequence.

Overhead = call - floor, in microseconds (rank 0's medians; every rank synchronises first).
Prints a table; ``--json PATH`` writes it.  Runs against whatever ``ulysses_mcore`` imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tools._world import run_world  # noqa: E402


def _median_us(fn, calls, barrier):
    times = []
    for _ in range(calls):
        barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _world(rank, world, port, calls, queue):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ulysses_mcore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    P, s_local, b, hq, hk, d = world, 8, 1, 2 * world, 2 * world, 8
    q, k, v = (torch.randn(s_local, b, h, d) for h in (hq, hk, hk))
    group = dist.group.WORLD

    def call():
        ulysses_attention(q, k, v, group=group, causal=True)

    ulysses_attention = ulysses_mcore.ulysses_attention
    send_qkv = torch.randn(s_local * b * (hq + 2 * hk) * d)
    recv_qkv = torch.empty_like(send_qkv)
    send_o = torch.randn(s_local * b * hq * d)
    recv_o = torch.empty_like(send_o)
    qf, kf, vf = (torch.randn(b, h // P, s_local * P, d) for h in (hq, hk, hk))

    def floor():
        dist.all_to_all_single(recv_qkv, send_qkv, group=group)
        F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        dist.all_to_all_single(recv_o, send_o, group=group)

    for _ in range(20):  # warm-up (the first call of a signature validates)
        call()
        floor()
    res = {}
    for name, fn in (("call", call), ("floor", floor), ("call2", call), ("floor2", floor)):
        res[name] = _median_us(fn, calls, dist.barrier)
    if rank == 0:
        queue.put(dict(P=world, call_us=min(res["call"], res["call2"]), floor_us=min(res["floor"], res["floor2"])))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", default="2,4,8")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    for P in (int(x) for x in a.degrees.split(",")):
        (r,) = run_world(P, _world, a.calls, what=f"the overhead benchmark at P={P}")
        r["overhead_us"] = r["call_us"] - r["floor_us"]
        rows.append(r)
        print(f"P={P}: call {r['call_us']:.0f} us, two all-to-alls + kernel {r['floor_us']:.0f} us, "
              f"overhead {r['overhead_us']:.0f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
