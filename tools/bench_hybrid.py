#!/usr/bin/env python3
"""Ulysses x ring on a fixed number of ranks: every split of the sequence-sharding degree.

    python tools/bench_hybrid.py [--world 4] [--seq 2048,4096] [--heads 8 --kv-heads 8 --head-dim 64] \
        [--repeats 5] [--out docs/perf]

One gloo world of ``--world`` processes.  For every ``U x C = world`` (Ulysses ``U`` inner,
ring ``C`` outer, dual-chunk order, causal) the same inputs run forward+backward through
``ulysses_attention(..., ring_group=...)``; medians over interleaved repeats after a warm-up.
Beside each time: bytes each rank sends per call (counted from the shapes, forward +
backward: the all-to-alls move ``(U-1)/U`` of q, k, v and the output; the ring shifts k/v
``C-1`` times forward, and backward k/v ``C-1`` times and their gradients ``C`` times) and the attention
FLOPs each rank computes (causal blocks only).  Writes ``bench_hybrid_P{world}.md/.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ulysses_mcore.devtools.bench import Report, run_world  # noqa: E402


def splits(world):
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0]


def sent_bytes(S, hq, hk, d, U, C, itemsize=4):
    """Bytes one rank sends per forward+backward call (b = 1)."""
    local = S // (U * C)
    a2a = 0
    if U > 1:
        qkv_out = local * (2 * hq + 2 * hk) * d * itemsize  # q, k, v in; out back
        a2a = 2 * qkv_out * (U - 1) / U  # forward and backward mirror each other
    ring = 0
    if C > 1:
        kv_blk = 2 * (S // C) * max(hk / U, 1) * d * itemsize  # k + v of this rank's heads after the a2a
        ring = (C - 1) * kv_blk + (C - 1) * kv_blk + C * kv_blk  # forward kv; backward kv, then dk/dv home
    return a2a, ring


def flops(S, hq, d, world):
    """Causal attention FLOPs per rank, forward + backward (2.5x forward), 4*S*S/2*d per head."""
    return 3.5 * 4 * (S * S / 2) * d * hq / world


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ulysses_mcore import ulysses_attention
    from ulysses_mcore.kernels.ring import ring_segments

    try:
        from ulysses_mcore import new_sequence_groups

        groups = {(U, C): new_sequence_groups(U, C) for U, C in splits(world)}
        results = []
        for S in args.seq:
            gen = torch.Generator().manual_seed(S)
            full = [
                torch.randn(S, 1, h, args.head_dim, generator=gen)
                for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)
            ]
            mine = [torch.cat([t[s : s + n] for s, n in ring_segments(rank, world, S, "load_balanced")]) for t in full]
            times = {k: [] for k in groups}
            for rep in range(args.repeats + 1):
                for key, (ug, rg) in groups.items():
                    q, k, v = (t.clone().requires_grad_() for t in mine[:3])
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = ulysses_attention(q, k, v, group=ug, ring_group=rg, causal=True, token_order="load_balanced")
                    out.backward(mine[3])
                    dist.barrier()
                    if rep:
                        times[key].append(time.perf_counter() - t0)
            for (U, C), ts in times.items():
                a2a, ring = sent_bytes(S, args.heads, args.kv_heads, args.head_dim, U, C)
                results.append(
                    dict(
                        seq=S,
                        ulysses=U,
                        ring=C,
                        ms=1e3 * statistics.median(ts),
                        a2a_mb=a2a / 1e6,
                        ring_mb=ring / 1e6,
                        gflop=flops(S, args.heads, args.head_dim, world) / 1e9,
                    )
                )
            if rank == 0:
                print(f"seq {S}: done", flush=True)
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def render(rec) -> str:
    """The table of a record (``world``, ``heads``, ``kv_heads``, ``head_dim``, ``repeats``, ``rows``)."""
    rows = rec["rows"]
    base = {r["seq"]: r["ms"] for r in rows if r["ring"] == 1}
    lines = [
        f"# Ulysses x ring on {rec['world']} gloo ranks (1 thread each), causal, fp32, "
        f"{rec['heads']} q / {rec['kv_heads']} kv heads of {rec['head_dim']}; fwd+bwd median of {rec['repeats']}",
        "",
        "| seq | ulysses x ring | ms | vs pure Ulysses | a2a MB sent / rank | ring MB sent / rank | attention GFLOP / rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['ulysses']} x {r['ring']} | {r['ms']:.1f} | {r['ms'] / base[r['seq']]:.2f} | "
            f"{r['a2a_mb']:.1f} | {r['ring_mb']:.1f} | {r['gflop']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq", default="2048,4096")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="docs/perf")
    args = p.parse_args(argv)
    args.seq = [int(x) for x in args.seq.split(",")]
    setup = {k: getattr(args, k) for k in ("world", "heads", "kv_heads", "head_dim", "repeats")}
    report = Report(args.out, f"bench_hybrid_P{args.world}", render, record=setup)
    report.section("rows", dict(run_world(args.world, _worker, args))[0])
    print(report.text)


if __name__ == "__main__":
    main()
