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


def _summary(results: List[dict], modes: int = 3) -> List[dict]:
    """Per world and run: each mode's numbers and the share of the gap closed."""
    rows = []
    for world, run in sorted({(r["world"], r["run"]) for r in results}):
        by = {r["mode"]: r for r in results if r["world"] == world and r["run"] == run}
        if len(by) < modes:  # a run still going
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


def _shares(r: dict, micro_batch_s: float) -> tuple:
    """(the share of the gap from the fixed degree to the equal-memory reference that the dynamic run
    closed, the share it could close at best): the best keeps the dynamic run's measured exchange and
    pays its micro-batches beyond the fixed degree's at the calibrated cost of one."""
    f, e, d = (r[m]["step_s"] for m in ("fixed", "equal memory", "dynamic"))
    extra = max(0, (r["dynamic"]["micro_batches_max"] or 0) - 2 * r["world"])
    best = e + r["dynamic"]["a2a_s_per_step"] + extra * micro_batch_s
    gap = f - e
    return ((f - d) / gap, (f - best) / gap) if gap > 0 else (float("nan"), float("nan"))


def _table_equal(rows: List[dict], micro_batch_s: float) -> List[str]:
    """Every run beside the equal-memory reference: the speed-up, micro-batches, pad, the gap's shares."""
    lines = [
        "| world | run | fixed tokens/s | dynamic | dynamic / fixed | equal memory | degree 1 | micro-batches a rank "
        "(dyn, fixed) | pad | gap closed | gap reachable | peak GB fixed, dyn | loss rel. diff |",
        "|---" * 13 + "|",
    ]
    for r in rows:
        f, d, e, o = (r[m] for m in ("fixed", "dynamic", "equal memory", "degree 1"))
        closed, reachable = _shares(r, micro_batch_s)
        lines.append(
            f"| {r['world']} | {r['run'] + 1} | {f['tokens_per_second']:.0f} | {d['tokens_per_second']:.0f} | "
            f"{d['tokens_per_second'] / f['tokens_per_second']:.3f} | {e['tokens_per_second']:.0f} | "
            f"{o['tokens_per_second']:.0f} | {d['micro_batches_max']}, {2 * r['world']} | {d['pad_percent']:.2f}% | "
            f"{100 * closed:.0f}% | {100 * reachable:.0f}% | {f['peak_gb']:.2f}, {d['peak_gb']:.2f} | "
            f"{r['loss_rel_diff']:.1e} |"
        )
    for world in sorted({r["world"] for r in rows}):
        ratios = [
            r["dynamic"]["tokens_per_second"] / r["fixed"]["tokens_per_second"] for r in rows if r["world"] == world
        ]
        lines += [
            "",
            f"world {world}: dynamic / fixed {statistics.median(ratios):.3f} median of {len(ratios)} interleaved runs "
            f"(spread {min(ratios):.3f}-{max(ratios):.3f})",
        ]
    return lines


def _bars(ax, rows: List[dict]) -> List[int]:
    """Per world, every mode's median tokens/s over the runs, the spread as error bars; the worlds."""
    modes = [m for m in ("fixed", "degree 1", "dynamic", "equal memory") if rows and all(m in r for r in rows)]
    width = 0.8 / max(1, len(modes))
    worlds = sorted({r["world"] for r in rows})
    for i, mode in enumerate(modes):
        per = [[r[mode]["tokens_per_second"] for r in rows if r["world"] == w] for w in worlds]
        mid = [statistics.median(v) for v in per]
        xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(worlds))]
        ax.bar(xs, mid, width=width, label=mode)
        spread = [[m - min(v) for m, v in zip(mid, per)], [max(v) - m for m, v in zip(mid, per)]]
        ax.errorbar(xs, mid, yerr=spread, fmt="none", color="k", capsize=3)
    return worlds


def _modes(rec: Dict) -> int:
    """Modes a run of the record has: 4 with the equal-memory reference (its setup names the micro-batch
    cost the reachable share charges), 3 in the records from before it."""
    return 4 if "micro_batch_s" in rec["setup"] else 3


def plot(rec: Dict, path: str) -> None:
    import matplotlib.pyplot as plt

    rows, gpus = _summary(rec["results"], _modes(rec)), rec["gpus"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    worlds = _bars(left, rows)
    left.set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
    left.set_ylabel("tokens/s (median of runs, bars: spread)")
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
    rows = _summary(rec["results"], _modes(rec))
    lines = [f"tools/bench_dynamic.py, {setup}", ""]
    lines += _table_equal(rows, setup["micro_batch_s"]) if _modes(rec) == 4 else _table(rows)
    lines += ["", "Cost model, Llama-8B bf16 on H200s:", ""]
    lines += ["| GPUs | fixed s/step | degree 1 | dynamic | dynamic speed-up |", "|---|---|---|---|---|"]
    lines += [
        f"| {g['gpus']} | {g['fixed']:.2f} | {g['degree 1']:.2f} | {g['dynamic']:.2f} | {g['fixed'] / g['dynamic']:.3f} |"
        for g in gpus
    ]
    return "\n".join(lines) + "\n"
