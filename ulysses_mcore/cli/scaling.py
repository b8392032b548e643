"""3D+SP scaling experiments: measure every layout of a world, fit a step-time model, predict.

    ulysses-mcore sweep --world 4 --out runs/sweep                 # measure (resumable)
    ulysses-mcore fit --out runs/sweep                             # calibrate, held-out error
    ulysses-mcore predict --preset h200 --model llama8b --seq-length 131072 --gpus 8,64,512

``sweep`` enumerates the layouts (``tp x ulysses x cp x pp x dp``) the trainer accepts for the
model and world (:mod:`ulysses_mcore.planning.step_time`: ``Topology``, head limits, batch split, and
``--budget-gb`` through the memory model), runs each as a real training run -- the project's
trainer (``ulysses-mcore pretrain --timing``) through ``torchrun``, or, with ``--megatron-lm
PATH``, Megatron-LM's ``pretrain_gpt.py`` through ``megatron_patches.launch`` (step time and
tokens/s only: Megatron-LM has no ``--timing``) -- and records per layout: tokens/s, step time,
the time in the Ulysses all-to-alls, ring shifts, attention kernel, MLP and optimizer (timers in
the step, the slowest rank's), peak memory and bytes sent per rank.  Medians over the iterations
after ``--warmup``.  Results: ``OUT/sweep.json`` (the run's settings and one row per layout; a
layout already there is not run again; a folder of another model or sequence is refused),
``OUT/sweep.md`` and ``OUT/sweep.png`` (tokens/s and peak memory per layout, sorted).

``fit`` calibrates the model's rates on the sweep's rows and reports its error on every
measured layout: fitted on all rows, and held out (fitted on half the layouts, predicting the
other half, both ways).  ``predict`` ranks the layouts of a GPU cluster (``--preset h100`` /
``h200``: datasheet bandwidths and stated efficiencies, see ``PRESETS``) for a model, sequence
and GPU count, with the memory budget of the preset.
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

from typing import List

from ..flags import explain
from ..megatron.trainer.arguments import layout_problem
from ..topology import Topology
from ..planning.shape import MODELS
from ..planning.step_time import (
    PRESETS,
    Run,
    enumerate_layouts,
    fit,
    gpu_rates,
    memory_gb,
    predict,
    rank_correlation,
)

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


def save_sweep(out: str, rec: dict) -> None:
    tmp = os.path.join(out, "sweep.json.tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, os.path.join(out, "sweep.json"))


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
        from ..megatron.compat.patches import CPU_FLAGS

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


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def run_layout(a, run: Run, lay: Topology, index: int, count: int) -> dict:
    """One training run of ``lay``; its row.  Shows a progress bar of its iterations."""
    log_dir = os.path.join(a.out, lay.name)
    cmd, pythonpath = _command(a, run, lay, log_dir)
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    t0, lines = time.time(), []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    ) as proc:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"iteration\s+(\d+)/\s*(\d+)", line)
            if m:
                print(f"\r  ({index}/{count}) {lay.name:26s} {_bar(int(m[1]), int(m[2]))}", end="", flush=True)
        rc = proc.wait()
    print(
        f"\r  ({index}/{count}) {lay.name:26s} {'done' if rc == 0 else f'FAILED (exit {rc})'} in "
        f"{time.time() - t0:.0f} s" + " " * 20,
        flush=True,
    )
    if rc != 0:
        errors = [ln for ln in lines if re.search(r"\w*Error\b|^error:", ln)][:5]  # the cause, then the tail
        return {"layout": lay.name, "error": "".join(errors + ["...\n"] + lines[-20:])}
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


def cmd_sweep(a) -> int:
    run = Run(a.model, a.seq_length, a.micro_batch_size, a.global_batch_size)
    try:
        layouts, dropped = enumerate_layouts(a.world, run, a.budget_gb, accepts=layout_problem)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if a.megatron_lm:  # skipped with the reason, not a failed sweep
        import torch

        layouts = runnable_by_megatron_lm(layouts, dropped, torch.cuda.is_available())
    if a.layouts:
        wanted = [Topology.parse(n) for n in a.layouts.split(",")]
        bad = [w.name for w in wanted if w not in layouts]
        if bad:
            why = "; ".join(f"{n}: {dropped.get(n, f'not a layout of {a.world} ranks')}" for n in bad)
            raise SystemExit(f"error: --layouts {','.join(bad)} cannot run: {why}")
        layouts = wanted
    rec = open_sweep(a.out, _settings(a, run))
    todo = [lay for lay in layouts if lay.name not in rec["rows"] or "error" in rec["rows"][lay.name]]
    print(
        f"sweep: {len(layouts)} layouts of {a.world} ranks for {a.model} at {a.seq_length} tokens "
        f"({len(layouts) - len(todo)} measured before, {len(dropped)} dropped)",
        flush=True,
    )
    for i, lay in enumerate(todo, 1):
        rec["rows"][lay.name] = run_layout(a, run, lay, i, len(todo))
        save_sweep(a.out, rec)  # resumable: every finished layout is on disk
    rec["dropped"] = dropped
    save_sweep(a.out, rec)
    write_report(a.out, rec)
    return 1 if any("error" in r for r in rec["rows"].values()) else 0


def write_report(out: str, rec: dict) -> None:
    rows = sorted((r for r in rec["rows"].values() if "error" not in r), key=lambda r: -r["tokens_per_s"])
    s = rec["settings"]
    lines = [
        f"Sweep: {s['model']} at {s['seq_length']} tokens, global batch {s['global_batch_size']}, "
        f"{s['world']} ranks ({s['runner']}); medians of the steady-state iterations, phases the slowest rank's.",
        "",
        "| layout | tokens/s | step ms | a2a ms | ring ms | attention ms | MLP ms | optimizer ms | "
        "a2a MB / rank | ring MB / rank | peak GB (plan) |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        ph = " | ".join("-" if r.get(p + "_s") is None else f"{r[p + '_s'] * 1e3:.1f}" for p in PHASES)  # untimed: -
        lines.append(
            f"| {r['layout']} | {r['tokens_per_s']:.0f} | {r['step_s'] * 1e3:.0f} | {ph} | "
            f"{_mb(r.get('a2a_bytes'))} | {_mb(r.get('ring_bytes'))} | "
            f"{'-' if r['peak_gb'] is None else format(r['peak_gb'], '.2f')} ({r['plan_peak_gb']:.2f}) |"
        )
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(out, rows, s)  # OUT/sweep.png


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def _plot(out: str, rows, s) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(rows) + 1.5), sharey=True)
    names = [r["layout"] for r in rows][::-1]
    ax1.barh(names, [r["tokens_per_s"] for r in rows][::-1], color="tab:blue")
    ax1.set_xlabel("tokens / s")
    ax2.barh(names, [r["peak_gb"] or 0 for r in rows][::-1], color="tab:orange")
    ax2.set_xlabel("peak memory per rank (GB)")
    fig.suptitle(f"{s['model']}, {s['seq_length']} tokens, {s['world']} ranks: every layout, fastest first")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sweep.png"), dpi=110)
    plt.close(fig)


def evaluate(rows, run: Run, gpus_per_node=None) -> dict:
    """The model fitted on all rows and held out (two halves, each predicted from the other)."""
    rows = sorted(rows, key=lambda r: r["layout"])
    halves = (rows[0::2], rows[1::2])
    result = {"in_sample": [], "held_out": []}
    rates = fit(rows, run, gpus_per_node)
    for r in rows:
        result["in_sample"].append(
            (r["layout"], r["step_s"], predict(rates, run, Topology.parse(r["layout"]), gpus_per_node)["step_s"])
        )
    for train, test in (halves, halves[::-1]):
        rates_h = fit(train, run, gpus_per_node)
        for r in test:
            result["held_out"].append(
                (r["layout"], r["step_s"], predict(rates_h, run, Topology.parse(r["layout"]), gpus_per_node)["step_s"])
            )
    result["rates"] = rates
    for key in ("in_sample", "held_out"):
        errs = [abs(p - m) / m for _, m, p in result[key]]
        result[f"{key}_max_err"] = max(errs)
        result[f"{key}_rank_corr"] = rank_correlation([m for _, m, _ in result[key]], [p for *_, p in result[key]])
    return result


def cmd_fit(a) -> int:
    with open(os.path.join(a.out, "sweep.json")) as f:
        rec = json.load(f)
    s = rec["settings"]
    run = Run.from_settings(s)
    rows = [r for r in rec["rows"].values() if "error" not in r and "attention_s" in r]
    if len(rows) < 2:
        raise SystemExit(f"error: {a.out}/sweep.json has {len(rows)} timed layouts; fit needs 2 or more (run sweep)")
    ev = evaluate(rows, run)
    lines = [
        "| layout | measured step ms | model (fitted on all) | error | model (held out) | error |",
        "|---" * 6 + "|",
    ]
    held = {n: p for n, _, p in ev["held_out"]}
    for n, m, p in ev["in_sample"]:
        lines.append(
            f"| {n} | {m * 1e3:.0f} | {p * 1e3:.0f} | {100 * (p - m) / m:+.1f}% | {held[n] * 1e3:.0f} | "
            f"{100 * (held[n] - m) / m:+.1f}% |"
        )
    lines += [
        "",
        f"max |error|: {100 * ev['in_sample_max_err']:.1f}% fitted on all, {100 * ev['held_out_max_err']:.1f}% "
        f"held out; rank correlation with the measured order: {ev['in_sample_rank_corr']:.2f} / "
        f"{ev['held_out_rank_corr']:.2f}",
    ]
    print("\n".join(lines))
    with open(os.path.join(a.out, "fit.json"), "w") as f:
        json.dump(ev, f, indent=1)
    with open(os.path.join(a.out, "fit.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


def best_layouts(preset_name: str, model: str, seq: int, gpus: int, global_batch: int, top: int = 3):
    """The ``top`` layouts of ``gpus`` GPUs by predicted tokens/s per GPU, and how many fit."""
    preset = PRESETS[preset_name]
    run = Run(model, seq, 1, global_batch, bf16=True, recompute="full", distributed_optimizer=True)
    try:
        layouts, _ = enumerate_layouts(gpus, run, preset["memory_gb"], accepts=layout_problem)
    except ValueError:
        return [], 0
    rates = gpu_rates(preset)
    scored = []
    for lay in layouts:
        p = predict(rates, run, lay, preset["gpus_per_node"])
        scored.append((run.global_batch_size * seq / p["step_s"] / gpus, lay, p, memory_gb(run, lay)))
    scored.sort(key=lambda x: -x[0])
    return scored[:top], len(layouts)


def cmd_predict(a) -> int:
    if a.preset not in PRESETS:
        raise SystemExit(f"error: --preset {a.preset!r} is unknown: use one of {sorted(PRESETS)}")
    for gpus in (int(g) for g in a.gpus.split(",")):
        top, n = best_layouts(a.preset, a.model, a.seq_length, gpus, a.global_batch_size or gpus, a.top)
        if not top:
            print(
                f"{gpus:5d} GPUs: no layout fits {a.model} at {a.seq_length} tokens in "
                f"{PRESETS[a.preset]['memory_gb']} GB"
            )
            continue
        for tps, lay, p, mem in top:
            print(
                f"{gpus:5d} GPUs ({n} layouts fit): {lay.name:28s} {tps:9.0f} tokens/s/GPU, step {p['step_s']:.2f} s, "
                f"peak {mem:.0f} GB"
            )
    return 0


# published settings, and how to read them as layouts of this model (assumptions in docs/scaling.md)
PUBLISHED = [
    # (what, preset, model, seq, gpus, {label: layout name}, the published tokens/s relative to the first)
    (
        "H200, Ulysses vs ring context parallelism at 64K (8 GPUs)",
        "h200",
        "llama8b",
        65536,
        8,
        {
            "cp 1": "tp1-u1-cp1-pp1-dp8",
            "Ulysses cp 2": "tp1-u2-cp1-pp1-dp4",
            "Ulysses cp 4": "tp1-u4-cp1-pp1-dp2",
            "ring cp 2": "tp1-u1-cp2-pp1-dp4",
            "ring cp 4": "tp1-u1-cp4-pp1-dp2",
        },
        {"cp 1": 1.0, "Ulysses cp 2": 0.92, "Ulysses cp 4": 1.01, "ring cp 2": 0.71, "ring cp 4": 0.68},
    ),
    (
        "DeepSpeed-Ulysses vs Megatron-LM sequence parallelism (tp 8), 32 GPUs, 128K",
        "h100",
        "llama8b",
        131072,
        32,
        {"Megatron SP (tp 8)": "tp8-u1-cp1-pp1-dp4", "Ulysses 8": "tp1-u8-cp1-pp1-dp4"},
        {"Megatron SP (tp 8)": 1.0, "Ulysses 8": 2.5},
    ),
]


def compare_published() -> List[str]:
    lines = [
        "| setting | layout | published (relative) | model (relative) | model tokens/s/GPU |",
        "|---|---|---|---|---|",
    ]
    for what, preset, model, seq, gpus, layouts, published in PUBLISHED:
        run = Run(model, seq, 1, gpus, bf16=True, recompute="full", distributed_optimizer=True)
        rates = gpu_rates(PRESETS[preset])
        tps = {
            k: run.global_batch_size
            * seq
            / predict(rates, run, Topology.parse(v), PRESETS[preset]["gpus_per_node"])["step_s"]
            / gpus
            for k, v in layouts.items()
        }
        first = next(iter(layouts))
        for k, v in layouts.items():
            lines.append(f"| {what} | {k} ({v}) | {published[k]:.2f} | {tps[k] / tps[first]:.2f} | {tps[k]:.0f} |")
    return lines


def cmd_report(a) -> int:
    """The best layouts for the 8B and 70B models at 128K / 512K / 1M on 8-1024 GPUs, and the published comparisons."""
    lines = [
        f"Preset {a.preset}: " + ", ".join(f"{k} {v}" for k, v in PRESETS[a.preset].items()),
        "",
        "| model | tokens | GPUs | best layout | tokens/s/GPU | step s | peak GB | runner-up | layouts that fit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in ("llama8b", "llama70b"):
        for seq in (131072, 524288, 1048576):
            for gpus in (8, 16, 32, 64, 128, 256, 512, 1024):
                top, n = best_layouts(a.preset, model, seq, gpus, gpus, 2)
                if not top:
                    lines.append(f"| {model} | {seq // 1024}K | {gpus} | -- (nothing fits) | | | | | 0 |")
                    continue
                (tps, lay, p, mem), second = top[0], (top[1][1].name if len(top) > 1 else "")
                lines.append(
                    f"| {model} | {seq // 1024}K | {gpus} | {lay.name} | {tps:.0f} | {p['step_s']:.1f} | "
                    f"{mem:.0f} | {second} | {n} |"
                )
            print(f"report: {model} at {seq} tokens", flush=True)
    lines += ["", *compare_published()]
    with open(a.report, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.report}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="measure every layout of a world (resumable)")
    s.add_argument("--world", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--model", default="tiny", choices=sorted(MODELS))
    s.add_argument("--seq-length", type=int, default=512)
    s.add_argument("--micro-batch-size", type=int, default=1)
    s.add_argument("--global-batch-size", type=int, default=4)
    s.add_argument("--iters", type=int, default=6)
    s.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    s.add_argument("--budget-gb", type=float, default=None)
    s.add_argument("--layouts", default=None, help="only these, e.g. tp1-u2-cp1-pp1-dp1,tp2-u1-cp1-pp1-dp1")
    s.add_argument("--megatron-lm", default=None, help="Megatron-LM folder: run its pretrain_gpt.py instead")
    f = sub.add_parser("fit", help="calibrate the step-time model on a sweep; its error, held out too")
    f.add_argument("--out", required=True)
    r = sub.add_parser("predict", help="best layouts of a GPU cluster for a model and sequence")
    r.add_argument("--preset", default="h200")
    r.add_argument("--model", default="llama8b", choices=sorted(MODELS))
    r.add_argument("--seq-length", type=int, default=131072)
    r.add_argument("--gpus", default="8,16,32,64,128,256,512,1024")
    r.add_argument("--global-batch-size", type=int, default=None, help="default: one sequence per GPU")
    r.add_argument("--top", type=int, default=1)
    t = sub.add_parser("report", help="best layouts for 8B / 70B at 128K-1M on 8-1024 GPUs; published comparisons")
    t.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    t.add_argument("--report", default="docs/perf/scaling_predictions.md")
    for sp in (s, f, r, t):
        explain(sp, SCALING_HELP)
    return p


SCALING_HELP = {
    "--world": "ranks of the world to sweep (torchrun on this machine)",
    "--out": "the sweep's folder (sweep.json; fit reads it and writes fit.json there)",
    "--model": "the model's shape by name (default: %(default)s)",
    "--seq-length": "tokens per sample (default: %(default)s)",
    "--micro-batch-size": "samples per micro-batch (default: %(default)s)",
    "--global-batch-size": "samples per step (default: %(default)s)",
    "--iters": "iterations per layout (default: %(default)s)",
    "--budget-gb": "leave out layouts whose planned peak exceeds this many GB per rank",
    "--preset": "the GPU cluster's datasheet rates (default: %(default)s)",
    "--gpus": "cluster sizes to rank layouts for, comma-separated (default: %(default)s)",
    "--top": "layouts to print per cluster size (default: %(default)s)",
    "--report": "the Markdown file to write (default: %(default)s)",
}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return {"sweep": cmd_sweep, "fit": cmd_fit, "predict": cmd_predict, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
