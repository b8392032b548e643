"""``ulysses-mcore sweep``: every layout of a world measured as a real training run, one row each.

The layouts (``tp x ulysses x cp x pp x dp``) the trainer accepts for the model and world
(:func:`~ulysses_mcore.planning.step_time.enumerate_layouts`), each run through ``torchrun`` -- the
project's trainer (``ulysses-mcore pretrain --timing``) or, with ``--megatron-lm PATH``, Megatron-LM's
``pretrain_gpt.py`` -- and recorded in ``OUT/sweep.json`` (resumable: a layout there is not run
again), ``OUT/sweep.md`` and ``OUT/sweep.png``, rewritten after every layout
(:class:`ulysses_mcore.devtools.bench.Report`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Tuple

from ..devtools.bench import Report, progress
from ..megatron.trainer.arguments import layout_problem
from ..planning.step_time import Run, enumerate_layouts, memory_gb
from ..topology import Topology

PHASES = ("a2a", "ring", "attention", "mlp", "optimizer")


# --------------------------------------------------------------------------- the sweep folder
def _settings(a, run: Run) -> dict:
    return dict(
        **run.settings(),
        world=a.world,
        iters=a.iters,
        runner="megatron-lm" if a.megatron_lm else "trainer",
    )


def open_sweep(out: str, settings: dict) -> dict:
    """The sweep record of ``out`` (new, or the one there if it is of the same settings)."""
    path = os.path.join(out, "sweep.json")
    if not os.path.exists(path):
        os.makedirs(out, exist_ok=True)
        return {"settings": settings, "rows": {}}
    with open(path) as f:
        rec = json.load(f)
    old = rec.get("settings", {})
    differ = {k: (old.get(k), v) for k, v in settings.items() if k != "iters" and old.get(k) != v}
    if differ:
        what = ", ".join(f"{k} {o!r} there vs {n!r} now" for k, (o, n) in differ.items())
        raise SystemExit(
            f"error: {path} is a sweep of other settings ({what}): use another --out, or the same settings"
        )
    return rec


# --------------------------------------------------------------------------- one layout
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(a, run: Run, lay: Topology, log_dir: str):
    common = [
        "--train-iters",
        str(a.iters),
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--lr-warmup-iters",
        "0",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-5",
    ]  # Megatron-LM has no default learning rate (and the trainer's --min-lr must stay below it)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(lay.world_size),
        "--master-port",
        str(_free_port()),
    ]
    if a.megatron_lm:
        from ..megatron.compat.patches import CPU_FLAGS  # Megatron-LM runs only: the patches room

        flags = (
            run.trainer_flags()
            + lay.flags()
            + common
            + [
                *CPU_FLAGS,
                "--mock-data",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                str(run.shape.vocab_size - 1),
                "--position-embedding-type",
                "rope",
                "--attention-dropout",
                "0",
                "--hidden-dropout",
                "0",
                "--eval-interval",
                "1000000",
            ]
        )

        env_path = os.pathsep.join([a.megatron_lm] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        return torchrun + [
            "-m",
            "megatron_patches.launch",
            os.path.join(a.megatron_lm, "pretrain_gpt.py"),
            *flags,
        ], env_path
    flags = run.trainer_flags() + lay.flags() + common + ["--timing", "--log-dir", log_dir]
    return torchrun + ["-m", "ulysses_mcore.megatron.trainer.pretrain", *flags], os.environ.get("PYTHONPATH", "")


def run_layout(a, run: Run, lay: Topology, position: Tuple[int, int], key: str = "") -> dict:
    """One training run of ``lay``, run ``position = (index, count)`` of the sweep; its row (timings in
    ``OUT/key``, the layout's name by default).  Shows a progress bar of its iterations."""
    index, count = position
    log_dir = os.path.join(a.out, key or lay.name)
    cmd, pythonpath = _command(a, run, lay, log_dir)
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    t0, lines = time.time(), []
    bar = progress(None, total=a.iters, desc=f"({index}/{count}) {key or lay.name}", unit="iter")
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    ) as proc:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"iteration\s+(\d+)/\s*(\d+)", line)
            if m:
                bar.update(int(m[1]) - bar.n)
        rc = proc.wait()
    bar.close()
    print(
        f"  ({index}/{count}) {key or lay.name:26s} {'done' if rc == 0 else f'FAILED (exit {rc})'} in {time.time() - t0:.0f} s",
        flush=True,
    )
    if rc != 0:
        errors = [ln for ln in lines if re.search(r"\w*Error\b|^error:", ln)][:5]  # the cause, then the tail
        return {"layout": lay.name, "seq_length": run.seq_length, "error": "".join(errors + ["...\n"] + lines[-20:])}
    return _row(a, run, lay, "".join(lines), log_dir)


def _iteration_lines(text: str):
    """(iteration, ms, peak GB or None) of every Megatron-style iteration line."""
    out = []
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): (\S+) \|.*", text):
        peak = re.search(r"peak memory \(GB\): (\S+)", m[0])
        out.append((int(m[1]), float(m[2]), float(peak[1]) if peak else None))
    return out


def _row(a, run: Run, lay: Topology, text: str, log_dir: str) -> dict:
    its = [x for x in _iteration_lines(text) if x[0] > a.warmup]
    if not its:
        raise SystemExit(f"error: {lay.name}: no iteration after --warmup {a.warmup} in the run's output")
    step = statistics.median(ms for _, ms, _ in its) / 1e3
    row = {
        "layout": lay.name,
        "seq_length": run.seq_length,
        "world": lay.world_size,
        "step_s": step,
        "tokens_per_s": run.global_batch_size * run.seq_length / step,
        "peak_gb": max((p for *_, p in its if p is not None), default=None),
        "plan_peak_gb": memory_gb(run, lay),
        "iterations": len(its),
    }
    row.update(_phases(log_dir, a.warmup))
    return row


def _phases(log_dir: str, warmup: int) -> dict:
    """Per phase: the median over iterations of the slowest rank's time; bytes: the largest rank's."""
    per_rank = []
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        if name.startswith("timing_rank") and name.endswith(".jsonl"):
            with open(os.path.join(log_dir, name)) as f:
                per_rank.append([json.loads(line) for line in f if line.strip()])
    if not per_rank:
        return {}
    out = {}
    for key in [f"{p}_s" for p in PHASES] + ["a2a_bytes", "ring_bytes"]:
        per_iter = [
            max(r[i][key] for r in per_rank) for i in range(len(per_rank[0])) if per_rank[0][i]["iteration"] > warmup
        ]
        out[key] = statistics.median(per_iter) if per_iter else 0.0
    return out


# --------------------------------------------------------------------------- commands
MEGATRON_LM_RING = (
    "Megatron-LM's pretrain_gpt.py runs a ring (context parallelism beyond Ulysses) only with Transformer "
    "Engine's attention ('Context parallelism is only supported by TEDotProductAttention!'), which needs a GPU"
)


def runnable_by_megatron_lm(layouts, dropped: dict, on_gpu: bool):
    """The layouts Megatron-LM's own script can run here; the others go to ``dropped`` with the reason."""
    keep = []
    for lay in layouts:
        if lay.cp > 1 and not on_gpu:
            dropped[lay.name] = MEGATRON_LM_RING
        else:
            keep.append(lay)
    return keep


def lengths_of(text: str):
    """``--seq-length 512,1024``: the lengths, in the order given (argparse's type)."""
    try:
        lengths = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length or a comma list of them (512,1024)") from None
    if any(n < 1 for n in lengths) or len(set(lengths)) != len(lengths):
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be positive and distinct")
    return lengths


def lengths_in(seq_length) -> list:
    """The lengths of a ``--seq-length`` value or a sweep record's ``seq_length`` (one, or a list)."""
    return list(seq_length) if isinstance(seq_length, list) else [seq_length]


def row_key(lay: Topology, seq: int, lengths) -> str:
    """A row's key in ``sweep.json``: the layout's name, with ``@length`` in a sweep of several lengths."""
    return lay.name if len(lengths) == 1 else f"{lay.name}@{seq}"


def _layouts_at(a, run: Run):
    """(the layouts to run at ``run``'s length, {dropped: reason}) -- refused by name where ``--layouts``
    asks for one that cannot run."""
    try:
        layouts, dropped = enumerate_layouts(a.world, run, a.budget_gb, accepts=layout_problem)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if a.megatron_lm:  # skipped with the reason, not a failed sweep
        import torch  # whether a GPU is here: only for Megatron-LM sweeps

        layouts = runnable_by_megatron_lm(layouts, dropped, torch.cuda.is_available())
    if a.layouts:
        wanted = [Topology.parse(n) for n in a.layouts.split(",")]
        bad = [w.name for w in wanted if w not in layouts]
        if bad:
            why = "; ".join(f"{n}: {dropped.get(n, f'not a layout of {a.world} ranks')}" for n in bad)
            raise SystemExit(f"error: --layouts {','.join(bad)} cannot run at {run.seq_length} tokens: {why}")
        layouts = wanted
    return layouts, dropped


def cmd_sweep(a) -> int:
    lengths = lengths_in(a.seq_length)
    runs = [Run(a.model, seq, a.micro_batch_size, a.global_batch_size) for seq in lengths]
    plans, dropped = [], {}
    for run in runs:  # every length checked before anything runs
        layouts, gone = _layouts_at(a, run)
        plans += [(run, lay) for lay in layouts]
        dropped.update({row_key(Topology.parse(n), run.seq_length, lengths): why for n, why in gone.items()})
    settings = _settings(a, runs[0])
    settings["seq_length"] = lengths[0] if len(lengths) == 1 else lengths
    rec = open_sweep(a.out, settings)
    report = Report(a.out, "sweep", render, plot, record=rec)
    keys = [row_key(lay, run.seq_length, lengths) for run, lay in plans]
    todo = [(k, p) for k, p in zip(keys, plans) if "error" in rec["rows"].get(k, {"error": "not run"})]
    print(
        f"sweep: {len(plans)} runs ({len(lengths)} lengths) of {a.world} ranks for {a.model} at "
        f"{','.join(map(str, lengths))} tokens ({len(plans) - len(todo)} measured before, {len(dropped)} dropped)",
        flush=True,
    )
    for i, (key, (run, lay)) in enumerate(todo, 1):
        rec["rows"][key] = run_layout(a, run, lay, (i, len(todo)), key)
        report.section("rows", rec["rows"])  # resumable: every finished layout is on disk, its table and plot
    report.section("dropped", dropped)
    return 1 if any("error" in r for r in rec["rows"].values()) else 0


def render(rec: dict) -> str:
    """The sweep's table, fastest layout first (``OUT/sweep.md``); one table per length."""
    s = rec["settings"]
    lengths = lengths_in(s["seq_length"])
    lines = [
        f"Sweep: {s['model']} at {','.join(map(str, lengths))} tokens, global batch {s['global_batch_size']}, "
        f"{s['world']} ranks ({s['runner']}); medians of the steady-state iterations, phases the slowest rank's.",
    ]
    for seq in lengths:
        rows = [r for r in rec["rows"].values() if "error" not in r and r.get("seq_length", seq) == seq]
        lines += [""] + ([f"At {seq} tokens:", ""] if len(lengths) > 1 else []) + _table(rows)
    return "\n".join(lines) + "\n"


def _table(rows) -> list:
    lines = [
        "| layout | tokens/s | step ms | a2a ms | ring ms | attention ms | MLP ms | optimizer ms | "
        "a2a MB / rank | ring MB / rank | peak GB (plan) |",
        "|---" * 11 + "|",
    ]
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        ph = " | ".join("-" if r.get(p + "_s") is None else f"{r[p + '_s'] * 1e3:.1f}" for p in PHASES)  # untimed: -
        lines.append(
            f"| {r['layout']} | {r['tokens_per_s']:.0f} | {r['step_s'] * 1e3:.0f} | {ph} | "
            f"{_mb(r.get('a2a_bytes'))} | {_mb(r.get('ring_bytes'))} | "
            f"{'-' if r['peak_gb'] is None else format(r['peak_gb'], '.2f')} ({r['plan_peak_gb']:.2f}) |"
        )
    return lines


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def plot(rec: dict, path: str) -> None:
    """Tokens/s and peak memory per layout, fastest first (``OUT/sweep.png``)."""
    import matplotlib.pyplot as plt  # optional (the plot extra): Report draws only where it is installed

    rows = sorted((r for r in rec["rows"].values() if "error" not in r), key=lambda r: -r["tokens_per_s"])
    s = rec["settings"]
    several = len(lengths_in(s["seq_length"])) > 1
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(rows) + 1.5), sharey=True)
    names = [f"{r['layout']} @{r['seq_length']}" if several else r["layout"] for r in rows][::-1]
    ax1.barh(names, [r["tokens_per_s"] for r in rows][::-1], color="tab:blue")
    ax1.set_xlabel("tokens / s")
    ax2.barh(names, [r["peak_gb"] or 0 for r in rows][::-1], color="tab:orange")
    ax2.set_xlabel("peak memory per rank (GB)")
    fig.suptitle(f"{s['model']}, {s['seq_length']} tokens, {s['world']} ranks: every layout, fastest first")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
