#!/usr/bin/env python3
"""Per-call host overhead of ``ulysses_attention`` and DeepSpeed's ``DistributedAttention``
beyond the floor: two all-to-alls and the kernel (forward), four and the kernel's backward.

    python tools/bench_overhead.py --degrees 2,4,8 --calls 200 --runs 5 --json docs/perf/bench_overhead.json

One gloo world of P processes per degree and run, tiny tensors (8 tokens per rank, 2P heads of
8: the exchange and the kernel cost little, so what remains is host work).  Steady state: each
timing is the median over ``--calls`` calls after a warm-up, every rank synchronised by a barrier
before each call, the better of two interleaved passes.  Measured in the same world, same shapes:

* ``ulysses``: ``ulysses_attention(q, k, v, group=..., causal=True)`` (SDPA inside);
* ``deepspeed``: ``deepspeed.sequence.layer.DistributedAttention`` around the same SDPA call;
* ``floor``: bare ``all_to_all_single`` calls of exactly the bytes a Ulysses call exchanges (q, k,
  v packed, then the output; backward: the output gradient, then q, k, v's) plus the same SDPA
  kernel on the gathered sequence (forward; forward + backward).

Overhead = implementation - floor, in microseconds (rank 0's medians); backward overhead = the
fwd+bwd overhead minus the forward one.  Prints a table per run and a min / median / max summary;
``--json PATH`` writes every run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ulysses_mcore.devtools.bench import Report, progress, run_world  # noqa: E402


def _median_us(fn, calls, barrier):
    times = []
    for _ in range(calls):
        barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _deepspeed(group):
    """DeepSpeed's DistributedAttention (its C++ shared-memory all-reduce op, which it would build
    with g++ for minutes and which this benchmark never calls, switched off)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.sequence.layer import DistributedAttention

    from ulysses_mcore.kernels.sdpa import sdpa_plain

    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if shm is not None:
        deepspeed.ops.__compatible_ops__[shm.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return DistributedAttention(
        lambda a, b, c, *_: sdpa_plain(a, b, c, causal=True), group, scatter_idx=2, gather_idx=0
    )


def _tasks(world, group):
    """name -> (forward-only call, forward + backward call)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ulysses_mcore

    P, s_local, b, h, d = world, 8, 1, 2 * world, 8
    q, k, v, dout = (torch.randn(s_local, b, h, d) for _ in range(4))
    ds = _deepspeed(group)
    qkv = [torch.randn(s_local * b * 3 * h * d) for _ in range(2)]
    o = [torch.randn(s_local * b * h * d) for _ in range(2)]
    full = [torch.randn(b, h // P, s_local * P, d) for _ in range(4)]

    def ulysses(q, k, v):
        return ulysses_mcore.ulysses_attention(q, k, v, group=group, causal=True)

    def deepspeed(q, k, v):
        return ds(q, k, v, 1)  # batch dim of [s, b, h, d]

    def impl(fn):
        grads = [t.clone().requires_grad_() for t in (q, k, v)]
        return (lambda: fn(q, k, v)), (lambda: fn(*grads).backward(dout))

    def floor_fwd():
        dist.all_to_all_single(qkv[1], qkv[0], group=group)
        out = F.scaled_dot_product_attention(*full[:3], is_causal=True)
        dist.all_to_all_single(o[1], o[0], group=group)
        return out

    leaves = [t.clone().requires_grad_() for t in full[:3]]

    def floor_fwd_bwd():
        dist.all_to_all_single(qkv[1], qkv[0], group=group)
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        dist.all_to_all_single(o[1], o[0], group=group)
        dist.all_to_all_single(o[0], o[1], group=group)
        out.backward(full[3])
        dist.all_to_all_single(qkv[0], qkv[1], group=group)

    return {"ulysses": impl(ulysses), "deepspeed": impl(deepspeed), "floor": (floor_fwd, floor_fwd_bwd)}


def _world(rank, world, port, calls, queue):
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tasks = _tasks(world, dist.group.WORLD)
    for fwd, both in tasks.values():  # warm-up (the first call of a signature validates and prepares)
        for _ in range(20):
            fwd()
            both()
    res = {}
    for _ in range(2):  # two interleaved passes, the better of each kept
        for name, (fwd, both) in tasks.items():
            for mode, fn in (("fwd", fwd), ("fwd_bwd", both)):
                t = _median_us(fn, calls, dist.barrier)
                res[f"{name}_{mode}_us"] = min(t, res.get(f"{name}_{mode}_us", float("inf")))
    if rank == 0:
        queue.put(dict(P=world, **res))
    dist.barrier()
    dist.destroy_process_group()


def _row(r):
    for name in ("ulysses", "deepspeed"):
        fwd = r[f"{name}_fwd_us"] - r["floor_fwd_us"]
        r[f"{name}_fwd_over_us"] = fwd
        r[f"{name}_bwd_over_us"] = (r[f"{name}_fwd_bwd_us"] - r["floor_fwd_bwd_us"]) - fwd
    return r


def render(rec) -> str:
    """The min / median / max table of a record (``rows``: one per run and degree)."""
    rows = rec["rows"]
    return _summary(rows, sorted({r["P"] for r in rows})) + "\n"


def _summary(rows, degrees):
    cols = ("ulysses_fwd_over_us", "ulysses_bwd_over_us", "deepspeed_fwd_over_us", "deepspeed_bwd_over_us")
    lines = [
        "| P | "
        + " | ".join(c.replace("_over_us", "").replace("_", " ") + " (min / median / max us)" for c in cols)
        + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for P in degrees:
        mine = [r for r in rows if r["P"] == P]
        cells = []
        for c in cols:
            vals = sorted(r[c] for r in mine)
            cells.append(f"{vals[0]:.0f} / {statistics.median(vals):.0f} / {vals[-1]:.0f}")
        lines.append(f"| {P} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", default="2,4,8")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--runs", type=int, default=1, help="separate worlds per degree (a new set of processes each)")
    p.add_argument("--json", default="runs/bench/bench_overhead.json", help="the record (the table beside it)")
    a = p.parse_args(argv)
    degrees = [int(x) for x in a.degrees.split(",")]
    report = Report(*os.path.split(a.json.removesuffix(".json")), render, record={"rows": []})
    cases = [(run, P) for run in range(1, a.runs + 1) for P in degrees]
    for run, P in progress(cases, desc="bench_overhead", unit="world"):
        (r,) = run_world(P, _world, a.calls, what=f"the overhead benchmark at P={P}")
        r = _row(dict(r, run=run))
        report.section("rows", report.record["rows"] + [r])
        print(
            f"[run {run}/{a.runs}] P={P}: floor {r['floor_fwd_us']:.0f} us fwd, {r['floor_fwd_bwd_us']:.0f} us "
            f"fwd+bwd | overhead beyond it: ulysses {r['ulysses_fwd_over_us']:.0f} fwd + "
            f"{r['ulysses_bwd_over_us']:.0f} bwd, DeepSpeed {r['deepspeed_fwd_over_us']:.0f} fwd + "
            f"{r['deepspeed_bwd_over_us']:.0f} bwd",
            flush=True,
        )
    print()
    print(report.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
