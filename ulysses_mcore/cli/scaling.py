"""3D+SP scaling experiments: measure every layout of a world, fit a step-time model, predict.

    ulysses-mcore sweep --world 2 --seq-length 512,1024 --out runs/cal    # measure (resumable)
    ulysses-mcore fit --out runs/cal                                      # calibrate: runs/cal/calibration.json
    ulysses-mcore predict --calibration runs/cal/calibration.json --model tiny --seq-length 2048 --gpus 2
    ulysses-mcore predict --preset h200 --model llama8b --seq-length 131072 --gpus 8,64,512

``sweep`` (:mod:`.sweep`) enumerates the layouts (``tp x ulysses x cp x pp x dp``) the trainer
accepts for the model and world at each length of ``--seq-length`` (a comma list), runs each as a
real training run -- the project's trainer (``ulysses-mcore pretrain --timing``) or, with
``--megatron-lm PATH``, Megatron-LM's ``pretrain_gpt.py`` -- and records one row per layout and
length: tokens/s, step time, the time in the Ulysses all-to-alls, ring shifts, attention kernel,
MLP and optimizer (the slowest rank's), peak memory and bytes sent per rank (``OUT/sweep.json``,
``.md``, ``.png``; a row already there is not run again).

``fit`` (:mod:`.fit`) calibrates the model's rates on every length of the sweeps and writes
``OUT/calibration.json``; its error on every row, held out by layout and on ``--held-out`` sweeps.
``predict`` ranks the layouts of a cluster for a model, sequence and GPU count: rates from a GPU
preset (``--preset h100`` / ``h200``: datasheet bandwidths and stated efficiencies, see
``PRESETS``; the preset's memory) or from ``--calibration FILE`` (every layout, each line saying
how far it extrapolates from the calibrated lengths and worlds).  ``report`` writes the table of
the best layouts for the 8B and 70B models at 128K-1M tokens on 8-1024 GPUs.
"""

from __future__ import annotations

import argparse
import sys

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..devtools.flags import explain
from .fit import cmd_fit
from .sweep import cmd_sweep, lengths_of
from ..megatron.trainer.arguments import layout_problem
from ..topology import Topology
from ..planning.shape import MODELS
from ..planning.calibration import Calibration, CalibrationError
from ..planning.step_time import (
    PRESETS,
    Run,
    enumerate_layouts,
    gpu_rates,
    memory_gb,
    predict,
)


@dataclass
class Pricing:
    """Where a prediction's rates come from: a GPU preset's datasheet numbers (bf16, full recompute,
    the distributed optimizer, the preset's memory and node size), or a calibration (the calibrated
    run's own settings -- fp32, its micro-batch -- within ``--budget-gb`` where given)."""

    rates: Dict[str, Dict[str, float]]
    budget_gb: Optional[float]
    gpus_per_node: Optional[int]
    calibration: Optional[Calibration] = None

    @classmethod
    def of(cls, a) -> Pricing:
        if a.preset not in PRESETS:
            raise SystemExit(f"error: --preset {a.preset!r} is unknown: use one of {sorted(PRESETS)}")
        if getattr(a, "calibration", None):
            try:
                cal = Calibration.load(a.calibration)
            except CalibrationError as e:
                raise SystemExit(f"error: {e}") from None
            return cls(cal.rates, getattr(a, "budget_gb", None), None, cal)
        return cls.preset(a.preset)

    @classmethod
    def preset(cls, name: str) -> Pricing:
        preset = PRESETS[name]
        return cls(gpu_rates(preset), preset["memory_gb"], preset["gpus_per_node"])

    def global_batch(self, gpus: int) -> int:
        """The default global batch: one sequence per GPU with a preset; a calibration's own samples per rank."""
        if not self.calibration:
            return gpus
        return max(1, round(self.calibration.global_batch_size * gpus / max(self.calibration.worlds)))

    def run(self, model: str, seq: int, global_batch: int) -> Run:
        if self.calibration:
            return Run(model, seq, self.calibration.micro_batch_size, global_batch)
        return Run(model, seq, 1, global_batch, bf16=True, recompute="full", distributed_optimizer=True)


def best_layouts(pricing: Pricing, model: str, seq: int, gpus: int, *, global_batch: int, top: Optional[int] = 3):
    """The ``top`` layouts of ``gpus`` GPUs by predicted tokens/s per GPU (all: ``None``), and how many fit."""
    run = pricing.run(model, seq, global_batch)
    try:
        layouts, _ = enumerate_layouts(gpus, run, pricing.budget_gb, accepts=layout_problem)
    except ValueError:
        return [], 0
    scored = []
    for lay in layouts:
        p = predict(pricing.rates, run, lay, pricing.gpus_per_node)
        scored.append((run.global_batch_size * seq / p["step_s"] / gpus, lay, p, memory_gb(run, lay)))
    scored.sort(key=lambda x: -x[0])
    return scored[:top], len(layouts)


def cmd_predict(a) -> int:
    pricing = Pricing.of(a)
    top = a.top if a.top is not None else (None if pricing.calibration else 1)
    for gpus in (int(g) for g in a.gpus.split(",")):
        batch = a.global_batch_size or pricing.global_batch(gpus)
        best, n = best_layouts(pricing, a.model, a.seq_length, gpus, global_batch=batch, top=top)
        if not best:
            budget = "" if pricing.budget_gb is None else f" in {pricing.budget_gb:g} GB"
            print(f"{gpus:5d} GPUs: no layout fits {a.model} at {a.seq_length} tokens{budget}")
            continue
        reach = f"; {pricing.calibration.reach_text(a.seq_length, gpus)}" if pricing.calibration else ""
        for tps, lay, p, mem in best:
            print(
                f"{gpus:5d} GPUs ({n} layouts fit): {lay.name:28s} {tps:9.0f} tokens/s per GPU, "
                f"step {p['step_s']:.2f} s, planned peak {mem:.3g} GB{reach}"
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
        pricing = Pricing.preset(preset)
        run = pricing.run(model, seq, gpus)
        tps = {
            k: run.global_batch_size
            * seq
            / predict(pricing.rates, run, Topology.parse(v), pricing.gpus_per_node)["step_s"]
            / gpus
            for k, v in layouts.items()
        }
        first = next(iter(layouts))
        for k, v in layouts.items():
            lines.append(f"| {what} | {k} ({v}) | {published[k]:.2f} | {tps[k] / tps[first]:.2f} | {tps[k]:.0f} |")
    return lines


def cmd_report(a) -> int:
    """The best layouts for the 8B and 70B models at 128K / 512K / 1M on 8-1024 GPUs, and the published comparisons."""
    pricing = Pricing.of(a)
    source = (
        f"Calibration {a.calibration} (lengths {pricing.calibration.lengths}, worlds {pricing.calibration.worlds})"
        if pricing.calibration
        else f"Preset {a.preset}: " + ", ".join(f"{k} {v}" for k, v in PRESETS[a.preset].items())
    )
    lines = [
        source,
        "",
        "| model | tokens | GPUs | best layout | tokens/s/GPU | step s | peak GB | runner-up | layouts that fit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in ("llama8b", "llama70b"):
        for seq in (131072, 524288, 1048576):
            for gpus in (8, 16, 32, 64, 128, 256, 512, 1024):
                top, n = best_layouts(pricing, model, seq, gpus, global_batch=gpus, top=2)
                if not top:
                    lines.append(f"| {model} | {seq // 1024}K | {gpus} | -- (nothing fits) | | | | | 0 |")
                    continue
                (tps, lay, p, mem), second = top[0], (top[1][1].name if len(top) > 1 else "")
                lines.append(
                    f"| {model} | {seq // 1024}K | {gpus} | {lay.name} | {tps:.0f} | {p['step_s']:.1f} | "
                    f"{mem:.0f} | {second} | {n} |"
                )
            print(f"report: {model} at {seq} tokens", flush=True)
    lines += ["", *compare_published()] if not pricing.calibration else []
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
    s.add_argument("--seq-length", type=lengths_of, default="512")
    s.add_argument("--micro-batch-size", type=int, default=1)
    s.add_argument("--global-batch-size", type=int, default=4)
    s.add_argument("--iters", type=int, default=6)
    s.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    s.add_argument("--budget-gb", type=float, default=None)
    s.add_argument("--layouts", default=None, help="only these, e.g. tp1-u2-cp1-pp1-dp1,tp2-u1-cp1-pp1-dp1")
    s.add_argument("--megatron-lm", default=None, help="Megatron-LM folder: run its pretrain_gpt.py instead")
    f = sub.add_parser(
        "fit", help="calibrate the step-time model on sweeps (calibration.json); its error, held out too"
    )
    f.add_argument("--out", required=True)
    f.add_argument("--sweep", action="append", default=None)
    f.add_argument("--held-out", action="append", default=None)
    r = sub.add_parser("predict", help="best layouts of a GPU cluster for a model and sequence")
    r.add_argument("--preset", default="h200")
    r.add_argument("--model", default="llama8b", choices=sorted(MODELS))
    r.add_argument("--seq-length", type=int, default=131072)
    r.add_argument("--gpus", default="8,16,32,64,128,256,512,1024")
    r.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default: one sequence per GPU (a preset), the calibrated samples per rank (--calibration)",
    )
    r.add_argument("--top", type=int, default=None)
    r.add_argument("--calibration", default=None)
    r.add_argument("--budget-gb", type=float, default=None)
    t = sub.add_parser("report", help="best layouts for 8B / 70B at 128K-1M on 8-1024 GPUs; published comparisons")
    t.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    t.add_argument("--report", default="docs/perf/scaling_predictions.md")
    t.add_argument("--calibration", default=None)
    for sp in (s, f, r, t):
        explain(sp, SCALING_HELP)
    return p


SCALING_HELP = {
    "--world": "ranks of the world to sweep (torchrun on this machine)",
    "--out": "the sweep's folder (sweep.json; fit reads it and writes fit.json, fit.md, calibration.json there)",
    "--model": "the model's shape by name (default: %(default)s)",
    "--seq-length": "tokens per sample; sweep: a comma list measures every layout at each (default: %(default)s)",
    "--micro-batch-size": "samples per micro-batch (default: %(default)s)",
    "--global-batch-size": "samples per step (default: %(default)s)",
    "--iters": "iterations per layout (default: %(default)s)",
    "--budget-gb": "leave out layouts whose planned peak exceeds this many GB per rank (predict: with --calibration)",
    "--preset": "the GPU cluster's datasheet rates (default: %(default)s)",
    "--gpus": "cluster sizes to rank layouts for, comma-separated (default: %(default)s)",
    "--top": "layouts to print per cluster size (default: 1 with a preset, every one with --calibration)",
    "--calibration": "rates from this calibration (`ulysses-mcore fit`'s DIR/calibration.json) instead of the preset's",
    "--sweep": "a sweep.json to fit (repeat for several; default: OUT/sweep.json)",
    "--held-out": "a sweep.json to predict from the fit and compare (a length or world not fitted; repeatable)",
    "--report": "the Markdown file to write (default: %(default)s)",
}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return {"sweep": cmd_sweep, "fit": cmd_fit, "predict": cmd_predict, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
