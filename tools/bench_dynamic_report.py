"""The report of ``tools/bench_dynamic.py``: the cost model's GPU prediction, JSON, Markdown, PNG."""

from __future__ import annotations

import statistics
from typing import Dict, List

from ulysses_mcore.planning.mix import long_tailed_lengths
from ulysses_mcore.planning.placement import Costs, samples_of, step_times
from ulysses_mcore.planning.shape import MODELS
from ulysses_mcore.planning.step_time import PRESETS, gpu_rates

GPU_SEQ = 131072  # tokens a sample on the GPUs: the same rule, lengths scaled by GPU_SEQ / 4096


def predict_gpus(mix: Dict, worlds=(8, 16, 32, 64), ulysses: int = 8) -> List[dict]:
    """Step times of fixed degree 8, degree 1 and the dynamic placement for Llama-8B (bf16) on H200s
    (the preset rates of ``ulysses-mcore predict``), two samples a rank, the mix's rule at GPU_SEQ."""
    costs = Costs.from_rates(gpu_rates(PRESETS["h200"]), MODELS["llama8b"], dtype_bytes=2)
    scale = GPU_SEQ // 4096
    lengths = long_tailed_lengths(
        4000, seed=1, median=mix["median"] * scale, sigma=mix["sigma"], longest=GPU_SEQ, whole_every=mix["whole_every"]
    )
    out = []
    for world in worlds:
        t = step_times(samples_of(lengths, GPU_SEQ, 2 * world), ranks=world, max_ulysses=ulysses, costs=costs)
        out.append({"gpus": world, **{k: round(v, 4) for k, v in t.items()}})
    return out


def _summary(results: List[dict]) -> List[dict]:
    """Per world and run: each mode's numbers and the share of the gap closed."""
    rows = []
    for world, run in sorted({(r["world"], r["run"]) for r in results}):
        by = {r["mode"]: r for r in results if r["world"] == world and r["run"] == run}
        if len(by) < 3:  # a run still going
            continue
        fixed, one, dyn = by["fixed"], by["degree 1"], by["dynamic"]
        gap = one["tokens_per_second"] - fixed["tokens_per_second"]
        closed = (dyn["tokens_per_second"] - fixed["tokens_per_second"]) / gap if gap > 0 else float("nan")
        same = max(abs(a - b) / abs(b) for a, b in zip(dyn["losses"], fixed["losses"]))
        rows.append({"world": world, "run": run, "closed": closed, "loss_rel_diff": same, **{m: by[m] for m in by}})
    return rows


def _table(rows: List[dict]) -> List[str]:
    lines = [
        "| world | run | fixed tokens/s | degree 1 | dynamic | dynamic / fixed | gap closed | a2a bytes dyn / fixed "
        "| busy max/mean fixed, dyn | peak GB fixed, dyn | loss rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, o, d = r["fixed"], r["degree 1"], r["dynamic"]
        ab = d["a2a_bytes_per_step"] / f["a2a_bytes_per_step"] if f["a2a_bytes_per_step"] else float("nan")
        lines.append(
            f"| {r['world']} | {r['run'] + 1} | {f['tokens_per_second']:.0f} | {o['tokens_per_second']:.0f} | "
            f"{d['tokens_per_second']:.0f} | {d['tokens_per_second'] / f['tokens_per_second']:.3f} | "
            f"{100 * r['closed']:.0f}% | {ab:.2f} | {f['busy_max_over_mean']:.3f}, {d['busy_max_over_mean']:.3f} | "
            f"{f['peak_gb']:.2f}, {d['peak_gb']:.2f} | {r['loss_rel_diff']:.1e} |"
        )
    return lines


def plot(rec: Dict, path: str) -> None:
    import matplotlib.pyplot as plt

    rows, gpus = _summary(rec["results"]), rec["gpus"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, mode in enumerate(("fixed", "degree 1", "dynamic")):
        worlds = sorted({r["world"] for r in rows})
        means = [statistics.mean(r[mode]["tokens_per_second"] for r in rows if r["world"] == w) for w in worlds]
        left.bar([x + (i - 1) * 0.25 for x in range(len(worlds))], means, width=0.25, label=mode)
        left.set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
    left.set_ylabel("tokens/s (mean of runs)")
    left.set_title("CPU, tiny model, long-tailed mix")
    left.legend(loc="lower left", framealpha=0.9)
    xs = [g["gpus"] for g in gpus]
    for mode in ("fixed", "degree 1", "dynamic"):
        right.plot(xs, [g["fixed"] / g[mode] for g in gpus], marker="o", label=mode)
    right.set_xscale("log", base=2)
    right.set_xlabel("H200 GPUs")
    right.set_ylabel("speed vs fixed degree 8 (cost model)")
    right.set_title(f"Llama-8B, {GPU_SEQ // 1024}K tokens a sample (predicted)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(rec: Dict) -> str:
    """The tables of a record (``setup``, ``results``: every run of every mode, ``gpus``: the cost model's)."""
    setup, gpus = rec["setup"], rec["gpus"]
    lines = [f"tools/bench_dynamic.py, {setup}", ""] + _table(_summary(rec["results"]))
    lines += ["", "Cost model, Llama-8B bf16 on H200s:", ""]
    lines += ["| GPUs | fixed s/step | degree 1 | dynamic | dynamic speed-up |", "|---|---|---|---|---|"]
    lines += [
        f"| {g['gpus']} | {g['fixed']:.2f} | {g['degree 1']:.2f} | {g['dynamic']:.2f} | {g['fixed'] / g['dynamic']:.3f} |"
        for g in gpus
    ]
    return "\n".join(lines) + "\n"
