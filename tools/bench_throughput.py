#!/usr/bin/env python3
"""Tokens/s and achieved FLOP/s of examples/pretrain_gpt.py against sequence length, ulysses 1 vs 2.

    python tools/bench_throughput.py [--seq 512,1024,2048,4096] [--iters 6] [--out docs/perf]

Both configurations use the same 2 CPU cores: ulysses 1 is one rank with 2 torch threads,
ulysses 2 is two ranks with 1 thread each.  Tokens/s is the median over the iterations
after the first two.  FLOPs per token, Megatron-style (forward+backward = 3x forward):

    6 * N_dense + 6 * V * h  +  6 * L * s * h        (last term: causal attention scores + values)

with N_dense the transformer-layer parameters, V the padded vocabulary, h the hidden size,
L the layers and s the sequence length.
"""

import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import tempfile

from ulysses_mcore.devtools.bench import Report, progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(layers=4, hidden=256, heads=8, groups=4, ffn=1024, vocab=384)


def flops_per_token(s, m=MODEL):
    h, L, f = m["hidden"], m["layers"], m["ffn"]
    d = h // m["heads"]
    dense = L * (h * (m["heads"] + 2 * m["groups"]) * d + m["heads"] * d * h + 2 * h * f)
    return 6 * dense + 6 * m["vocab"] * h + 6 * L * s * h


def run(nproc, threads, seq, iters, gbs):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = tempfile.mkdtemp(prefix="tput_")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(port),
        os.path.join(ROOT, "examples", "pretrain_gpt.py"),
        "--ulysses-degree",
        str(nproc),
        "--num-layers",
        str(MODEL["layers"]),
        "--hidden-size",
        str(MODEL["hidden"]),
        "--num-attention-heads",
        str(MODEL["heads"]),
        "--num-query-groups",
        str(MODEL["groups"]),
        "--ffn-hidden-size",
        str(MODEL["ffn"]),
        "--seq-length",
        str(seq),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        "--lr-warmup-iters",
        "1",
        "--log-dir",
        d,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=d)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    with open(os.path.join(d, "metrics.csv")) as f:
        rows = [x for x in csv.DictReader(f) if x["kind"] == "train"]
    return statistics.median(float(x["tokens_per_second"]) for x in rows[2:])


def render(rec) -> str:
    """The table of a record (``model``, ``global_batch_size``, ``rows``)."""
    rows = rec["rows"]
    lines = [
        f"examples/pretrain_gpt.py, model {rec['model']}, fp32, global batch {rec['global_batch_size']}, 2 CPU cores "
        "(ulysses 1: 1 rank x 2 threads; ulysses 2: 2 ranks x 1 thread); median tokens/s after 2 warm-up iterations.",
        "",
        "| seq | ulysses 1 tokens/s | GFLOP/s | ulysses 2 tokens/s | GFLOP/s | u2 / u1 |",
        "|---|---|---|---|---|---|",
    ]
    for s in sorted({r["seq"] for r in rows}):
        r1 = next((r for r in rows if r["seq"] == s and r["ulysses"] == 1), None)
        r2 = next((r for r in rows if r["seq"] == s and r["ulysses"] == 2), None)
        if r1 is None or r2 is None:  # a section still running
            continue
        lines.append(
            f"| {s} | {r1['tokens_per_second']:.0f} | {r1['gflops_per_second']:.2f} | "
            f"{r2['tokens_per_second']:.0f} | {r2['gflops_per_second']:.2f} | "
            f"{r2['tokens_per_second'] / r1['tokens_per_second']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="512,1024,2048,4096")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--global-batch-size", type=int, default=2)
    p.add_argument("--out", default="docs/perf")
    a = p.parse_args(argv)
    report = Report(
        a.out, "bench_throughput", render, record={"model": MODEL, "global_batch_size": a.global_batch_size}
    )
    rows = []
    cases = [(int(s), u, threads) for s in a.seq.split(",") for u, threads in ((1, 2), (2, 1))]
    for s, u, threads in progress(cases, desc="bench_throughput"):
        tps = run(u, threads, s, a.iters, a.global_batch_size)
        rows.append(
            {"seq": s, "ulysses": u, "tokens_per_second": tps, "gflops_per_second": tps * flops_per_token(s) / 1e9}
        )
        report.section("rows", rows)
    print(report.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
