"""What a run writes beside its checkpoints: ``metrics.csv`` (the logging rank's row per logged
iteration) and, with ``--timing``, ``timing_rank<R>.jsonl`` (every rank's phase times and bytes)."""

from __future__ import annotations

import csv
import json
import os

import torch.distributed as dist

from ulysses_mcore.megatron.layer import groups as built
from ulysses_mcore.megatron.trainer.arguments import metrics_dir
from ulysses_mcore.megatron.trainer.timing import StepTimer


class MetricsLog:
    """metrics.csv of the logging rank: one row per logged iteration (a resumed run drops the rows
    after its checkpoint: those iterations are trained again)."""

    COLUMNS = [
        "iteration",
        "consumed_samples",
        "lm_loss",
        "lr",
        "grad_norm",
        "ms_per_iter",
        "tokens_per_second",
        "peak_memory_gb",
        "kind",
    ]

    def __init__(self, args, iteration):
        log_dir = metrics_dir(args)
        os.makedirs(log_dir, exist_ok=True)
        metrics = os.path.join(log_dir, "metrics.csv")
        fresh = not os.path.exists(metrics) or not args.load
        if not fresh:
            dropped = trim_metrics(metrics, iteration)
            if dropped:
                print(
                    f"[ulysses-mcore] {metrics}: dropped {dropped} rows after iteration {iteration} "
                    "(they are trained again)",
                    flush=True,
                )
        self.fh = open(metrics, "w" if fresh else "a", newline="")
        self.writer = csv.writer(self.fh)
        if fresh:
            self.writer.writerow(self.COLUMNS)

    def row(self, **fields):
        """One row of :attr:`COLUMNS` by name (a column not given is empty)."""
        unknown = set(fields) - set(self.COLUMNS)
        if unknown:
            raise KeyError(f"metrics.csv has no column {sorted(unknown)}")
        self.writer.writerow([fields.get(c, "") for c in self.COLUMNS])
        self.fh.flush()


class TimingLog:
    """``--timing``: each iteration's phase times and bytes sent (:mod:`.timing`), one JSON line per
    iteration in ``timing_rank<R>.jsonl`` beside metrics.csv, on every rank."""

    def __init__(self, args, model, optimizer, groups=None):
        a2a = built.get_ulysses_group()
        if groups is not None:  # --dynamic-ulysses: every degree's groups this rank is in
            a2a = groups.mine()
        self.timer = StepTimer(a2a, built.get_ring_group()).install(model, optimizer)
        os.makedirs(metrics_dir(args), exist_ok=True)
        path = os.path.join(metrics_dir(args), f"timing_rank{dist.get_rank()}.jsonl")
        self.fh = open(path, "a" if args.load else "w")  # a resumed run continues the file
        self.dumps = json.dumps

    def record(self, iteration):
        self.fh.write(self.dumps({"iteration": iteration, **self.timer.take()}) + "\n")
        self.fh.flush()


def trim_metrics(csv_path: str, iteration: int) -> int:
    """Drop the rows after ``iteration`` (they are about to be trained again): one row per
    iteration across resumes.  Atomic; returns the number of rows dropped."""
    if not os.path.exists(csv_path):
        return 0
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return 0
    keep = [rows[0]] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= iteration]
    dropped = len(rows) - len(keep)
    if dropped:
        tmp = csv_path + ".tmp"
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(keep)
        os.replace(tmp, csv_path)
    return dropped
