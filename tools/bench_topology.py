#!/usr/bin/env python3
"""Time the pure group enumeration at large world sizes (default 131072 ranks).

python tools/bench_topology.py [--world-size 131072]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ulysses_mcore.topology import Topology  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=131072)
    a = p.parse_args()
    configs = [dict(tp=8, ulysses=8, pp=8), dict(tp=8, ulysses=4, cp=4, pp=4), dict(tp=4, ulysses=8, cp=2, pp=16, ep=8)]
    print(f"| config (world {a.world_size}) | axis set | groups | enumerate (ms) | as lists (ms) |")
    print("|---|---|---|---|---|")
    for cfg in configs:
        t = Topology(a.world_size, **cfg)
        for axes in ("tp", "ulysses", "cp", "dp", "pp", "dp-ulysses-cp") + (("ep",) if t.ep > 1 else ()):
            t0 = time.perf_counter()
            arr = t.group_array(axes)
            t1 = time.perf_counter()
            t.groups(axes)
            t2 = time.perf_counter()
            name = " ".join(f"{k}{v}" for k, v in cfg.items())
            print(f"| {name} | {axes} | {arr.shape[0]} | {(t1 - t0) * 1e3:.2f} | {(t2 - t0) * 1e3:.1f} |")
        t0 = time.perf_counter()
        for r in range(0, a.world_size, a.world_size // 64):
            t.group_of("ulysses", r)
        print(f"| {name} | group_of x64 | - | {(time.perf_counter() - t0) * 1e3:.1f} | - |")


if __name__ == "__main__":
    main()
