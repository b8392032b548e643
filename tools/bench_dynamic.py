#!/usr/bin/env python3
"""``--dynamic-ulysses`` on a long-tailed document mix: tokens/s, all-to-all bytes, busy time, memory.

    python tools/bench_dynamic.py [--worlds 2,4] [--runs 3] [--seq-length 4096] [--out runs/bench]

The mix: :mod:`ulysses_mcore.planning.mix`'s seeded rule through ``ulysses-mcore preprocess``,
``--mix heavy`` (log-normal lengths, median 200, sigma 1.2, every 25th document a whole sample) or
``light`` (sigma 1.0, every 100th).  For each world
``W`` and each run, three trainings of the same global batches (``ulysses-mcore pretrain
--reset-attention-mask --timing``, the tiny model: 2 layers, hidden 128, 8 heads): the fixed degree
``W``; degree 1 (pure data parallelism: every rank whole samples, no exchange); and
``--dynamic-ulysses`` with ``--ulysses-degree W``.  Per training: median tokens/s after two
warm-up iterations, all-to-all bytes a step (all ranks), busy time max / mean over ranks (each
rank's CPU time in the step), peak memory (the largest rank's), and the loss line.  Then the cost
model's prediction for the same mix at 128K tokens a sample on 8-64 H200s (degree 8 in a node).
Writes ``bench_dynamic_<mix>.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.bench_dynamic_report import plot, predict_gpus, render  # noqa: E402
from ulysses_mcore.devtools.bench import Report, progress  # noqa: E402
from ulysses_mcore.megatron.trainer.dynamic import CPU_RATES  # noqa: E402
from ulysses_mcore.planning.placement import Costs  # noqa: E402
from ulysses_mcore.planning.shape import ModelShape  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8", "--num-query-groups", "4"]
MIXES = {  # name -> the rule's parameters (ulysses_mcore.planning.mix)
    "heavy": dict(median=200, sigma=1.2, whole_every=25),  # a whole-sample document every 25th
    "light": dict(median=200, sigma=1.0, whole_every=100),  # a few whole-sample documents
}
MODES = {  # name -> (flags beside the world's degree W, k: the run's --seq-length / k, global batch x k)
    "fixed": lambda W: (["--ulysses-degree", str(W)], 1),
    "degree 1": lambda W: (["--ulysses-degree", "1"], 1),
    "dynamic": lambda W: (["--ulysses-degree", str(W), "--dynamic-ulysses"], 1),
    # the fixed degree's load a rank with no exchange: degree 1 at --seq-length / W, W x the samples
    "equal memory": lambda W: (["--ulysses-degree", "1"], W),
}


def make_mix(folder: str, seq: int, documents: int, mix: dict) -> str:
    """The seeded long-tailed mix as Megatron's indexed dataset; returns its prefix."""
    from ulysses_mcore.planning.mix import long_tailed_lengths, write_jsonl

    path = os.path.join(folder, "mix.jsonl")
    write_jsonl(path, long_tailed_lengths(documents, seed=1, longest=seq, **mix), seed=1)
    prefix = os.path.join(folder, "mix")
    command = os.path.join(os.path.dirname(sys.executable), "ulysses-mcore")
    subprocess.run([command, "preprocess", "--input", path, "--output-prefix", prefix], check=True, capture_output=True)
    return prefix


def train(world: int, mode, a, prefix: str, log_dir: str) -> dict:
    """One training run under torchrun; its measurements."""
    flags, k = mode
    bindir = os.path.dirname(sys.executable)
    cmd = [os.path.join(bindir, "torchrun"), "--nproc-per-node", str(world), "--no-python"]
    cmd += [os.path.join(bindir, "ulysses-mcore"), "pretrain", *MODEL, *flags, "--reset-attention-mask"]
    cmd += [
        "--seq-length",
        str(a.seq_length // k),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(2 * world * k),
    ]
    cmd += ["--train-iters", str(a.iters), "--lr-warmup-iters", "1", "--data-path", prefix, "--split", "100,0,0"]
    cmd += ["--timing", "--log-dir", log_dir]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=log_dir)
    if r.returncode:
        raise SystemExit(f"error: {' '.join(flags)} at world {world} failed:\n{r.stderr[-3000:]}")
    return measure(log_dir, r.stdout)


def _timing(log_dir: str) -> list:
    """Each rank's timing records after the two warm-up iterations."""
    ranks = []
    for path in sorted(glob.glob(os.path.join(log_dir, "timing_rank*.jsonl"))):
        with open(path) as f:
            ranks.append([json.loads(line) for line in f][2:])
    return ranks


def _schedule_counts(sched: list) -> dict:
    """From the dynamic runs' schedule lines: the most micro-batches a rank ran, the mean pad share."""
    found = [re.search(r"dynamic: (\d+)-(\d+) micro-batches a rank .*\| pad (\S+)% of tokens", ln) for ln in sched]
    found = [m for m in found if m]
    if not found:
        return {"micro_batches_max": None, "pad_percent": None}
    return {
        "micro_batches_max": max(int(m[2]) for m in found),
        "pad_percent": statistics.mean(float(m[3]) for m in found),
    }


def _per_step(ranks: list) -> dict:
    """From every rank's timing records: the all-to-all bytes (all ranks) and seconds (the slowest
    rank's) a step, and the busiest rank's CPU time over the mean, averaged over the steps."""
    steps = range(len(ranks[0]))
    busy = [max(r[i]["cpu_s"] for r in ranks) / statistics.mean(r[i]["cpu_s"] for r in ranks) for i in steps]
    return {
        "a2a_bytes_per_step": statistics.mean(sum(r[i]["a2a_bytes"] for r in ranks) for i in steps),
        "a2a_s_per_step": statistics.mean(max(r[i]["a2a_s"] for r in ranks) for i in steps),
        "busy_max_over_mean": statistics.mean(busy),
    }


def measure(log_dir: str, stdout: str) -> dict:
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        rows = [x for x in csv.DictReader(f) if x["kind"] == "train"]
    ranks = _timing(log_dir)
    sched = [ln.strip() for ln in stdout.splitlines() if "dynamic:" in ln]
    return {
        "tokens_per_second": statistics.median(float(x["tokens_per_second"]) for x in rows[2:]),
        "step_s": statistics.median(float(x["ms_per_iter"]) for x in rows[2:]) / 1e3,
        **_per_step(ranks),
        **_schedule_counts(sched),
        "peak_gb": max(r[-1]["peak_gb"] for r in ranks),
        "losses": [float(x["lm_loss"]) for x in rows],
        "schedule": sched[-1] if sched else "",
    }


def micro_batch_seconds() -> float:
    """A micro-batch's own time on this machine for the benchmark's model: the trainer's CPU
    calibration, as its placement prices it (what the gap's reachable share charges an extra one)."""
    shape = ModelShape(num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=4)
    return Costs.from_rates(CPU_RATES, shape).cell


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--documents", type=int, default=1500)
    p.add_argument("--mix", choices=sorted(MIXES), default="heavy")
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_dynamic_")
    prefix = make_mix(work, a.seq_length, a.documents, MIXES[a.mix])
    setup = dict(vars(a), rule=MIXES[a.mix], model=" ".join(MODEL), micro_batch_s=micro_batch_seconds())
    record = {"setup": setup, "results": [], "gpus": predict_gpus(MIXES[a.mix])}
    report = Report(a.out, f"bench_dynamic_{a.mix}", render, plot, record=record)
    cases = [(w, run, mode) for w in (int(x) for x in a.worlds.split(",")) for run in range(a.runs) for mode in MODES]
    for world, run, mode in progress(cases, desc=f"bench_dynamic {a.mix}"):  # interleaved: a run is every mode
        log_dir = os.path.join(work, f"w{world}_r{run}_{mode.replace(' ', '')}")
        os.makedirs(log_dir)
        row = {"world": world, "run": run, "mode": mode, **train(world, MODES[mode](world), a, prefix, log_dir)}
        report.section("results", report.record["results"] + [row])
    print(report.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
