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
import sys

from typing import List

from ..bench import Report
from ..flags import explain
from .sweep import cmd_sweep
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
    report = Report(a.out, "fit", render_fit, record=evaluate(rows, run))
    print(report.write(), end="")
    return 0


def render_fit(ev: dict) -> str:
    """The fit's table (``OUT/fit.md``): each layout measured, fitted on all rows, held out."""
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
    return "\n".join(lines) + "\n"


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
