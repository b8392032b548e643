#!/usr/bin/env python3
"""Time the pure group enumeration at large world sizes (default 131072 ranks).

python tools/bench_topology.py [--world-size 131072] [--out runs/bench]

Writes ``bench_topology.json`` and ``.md`` under --out.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ulysses_mcore.devtools.bench import Report, progress  # noqa: E402
from ulysses_mcore.topology import Topology  # noqa: E402

CONFIGS = [dict(tp=8, ulysses=8, pp=8), dict(tp=8, ulysses=4, cp=4, pp=4), dict(tp=4, ulysses=8, cp=2, pp=16, ep=8)]


def render(rec) -> str:
    """The table of a record (``world_size``, ``rows``: config, axes, groups, ms)."""
    lines = [
        f"| config (world {rec['world_size']}) | axis set | groups | enumerate (ms) | as lists (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rec["rows"]:
        lists = "-" if r["lists_ms"] is None else f"{r['lists_ms']:.1f}"
        groups = "-" if r["groups"] is None else r["groups"]
        lines.append(f"| {r['config']} | {r['axes']} | {groups} | {r['enumerate_ms']:.2f} | {lists} |")
    return "\n".join(lines) + "\n"


def time_config(world_size: int, cfg: dict) -> list:
    """Each axis set's enumeration (as an array, then as lists), then 64 ``group_of`` lookups."""
    t, name, rows = Topology(world_size, **cfg), " ".join(f"{k}{v}" for k, v in cfg.items()), []
    for axes in ("tp", "ulysses", "cp", "dp", "pp", "dp-ulysses-cp") + (("ep",) if t.ep > 1 else ()):
        t0 = time.perf_counter()
        arr = t.group_array(axes)
        t1 = time.perf_counter()
        t.groups(axes)
        t2 = time.perf_counter()
        rows.append(
            dict(config=name, axes=axes, groups=arr.shape[0], enumerate_ms=(t1 - t0) * 1e3, lists_ms=(t2 - t0) * 1e3)
        )
    t0 = time.perf_counter()
    for r in range(0, world_size, world_size // 64):
        t.group_of("ulysses", r)
    rows.append(
        dict(
            config=name, axes="group_of x64", groups=None, enumerate_ms=(time.perf_counter() - t0) * 1e3, lists_ms=None
        )
    )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=131072)
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args(argv)
    report = Report(a.out, "bench_topology", render, record={"world_size": a.world_size, "rows": []})
    for cfg in progress(CONFIGS, desc="bench_topology", unit="config"):
        report.section("rows", report.record["rows"] + time_config(a.world_size, cfg))
    print(report.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
