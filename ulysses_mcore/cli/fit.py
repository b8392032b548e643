"""``ulysses-mcore fit``: the step-time model calibrated on measured sweeps (``DIR/calibration.json``).

Fits the rates of :mod:`ulysses_mcore.planning.step_time` on every timed row of the sweeps given
(``--sweep``, repeatable; every length of each), reports the error on every row -- fitted on all,
held out by layout (each half of the layouts predicted from the other), and on ``--held-out``
sweeps (a length or world the fit never saw) -- as ``DIR/fit.json``, ``fit.md`` and ``fit.png``,
and writes the rates with what they were fitted on as ``DIR/calibration.json``
(:class:`~ulysses_mcore.planning.calibration.Calibration`), which ``--calibration`` feeds to
``predict``, ``plan``, ``report`` and ``pretrain --dynamic-ulysses``.
"""

from __future__ import annotations

import json
import os

from ..devtools.bench import Report
from ..planning.calibration import Calibration
from ..planning.step_time import Run, fit, predict, rank_correlation, row_run
from ..topology import Topology
from .sweep import lengths_in


def _name(row: dict, several: bool) -> str:
    return f"{row['layout']}@{row['seq_length']}" if several else row["layout"]


def _predicted(rates, row: dict, run: Run, gpus_per_node=None) -> float:
    return predict(rates, row_run(row, run), Topology.parse(row["layout"]), gpus_per_node)["step_s"]


def _scored(rates, rows, run: Run, several: bool, gpus_per_node=None) -> list:
    """(name, measured, predicted) of every row."""
    return [(_name(r, several), r["step_s"], _predicted(rates, r, run, gpus_per_node)) for r in rows]


def _errors(result: dict, key: str) -> None:
    """The largest relative error of ``result[key]``'s rows and their rank correlation, beside them."""
    errs = [abs(p - m) / m for _, m, p in result[key]]
    result[f"{key}_max_err"] = max(errs)
    result[f"{key}_rank_corr"] = rank_correlation([m for _, m, _ in result[key]], [p for *_, p in result[key]])


def evaluate(rows, run: Run, gpus_per_node=None, held_out_rows=()) -> dict:
    """The model fitted on all rows, held out by layout (two halves of the layouts, each predicted
    from the other), and, given ``held_out_rows`` (another sweep: a length or world not fitted),
    each of those predicted from the fit on all rows."""
    several = len({r.get("seq_length", run.seq_length) for r in [*rows, *held_out_rows]}) > 1
    rows = sorted(rows, key=lambda r: (r["layout"], r.get("seq_length", 0)))
    names = sorted({r["layout"] for r in rows})
    halves = [[r for r in rows if names.index(r["layout"]) % 2 == k] for k in (0, 1)]
    rates = fit(rows, run, gpus_per_node)
    result = {"in_sample": _scored(rates, rows, run, several, gpus_per_node), "held_out": []}
    for train, test in (halves, halves[::-1]):
        result["held_out"] += _scored(
            fit(train, run, gpus_per_node) if train else rates, test, run, several, gpus_per_node
        )
    if held_out_rows:
        result["held_out_sweep"] = _scored(rates, held_out_rows, run, several, gpus_per_node)
    result["rates"] = rates
    for key in ("in_sample", "held_out", "held_out_sweep"):
        if key in result:
            _errors(result, key)
    return result


def _timed_rows(path: str):
    """(settings, the timed rows) of a sweep record; refused by name where there is nothing to fit."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"error: --sweep {path}: cannot read it ({e}); run `ulysses-mcore sweep --out DIR` first"
        ) from None
    s = rec["settings"]
    first = lengths_in(s["seq_length"])[0]
    rows = [dict(r, seq_length=r.get("seq_length", first)) for r in rec["rows"].values()]
    return s, [r for r in rows if "error" not in r and "attention_s" in r]


def _same_run(paths, settings) -> Run:
    """The run every sweep made (one model and batch: a calibration is of one model)."""
    keys = ("model", "micro_batch_size", "global_batch_size")
    for p, s in zip(paths[1:], settings[1:]):
        differ = [f"{k} {settings[0][k]!r} vs {s[k]!r}" for k in keys if s[k] != settings[0][k]]
        if differ:
            raise SystemExit(
                f"error: --sweep {paths[0]} and {p} are of other runs ({', '.join(differ)}): fit one model"
            )
    return Run.from_settings(dict(settings[0], seq_length=lengths_in(settings[0]["seq_length"])[0]))


def cmd_fit(a) -> int:
    paths = a.sweep or [os.path.join(a.out, "sweep.json")]
    loaded = [_timed_rows(p) for p in paths]
    run = _same_run(paths, [s for s, _ in loaded])
    rows = [r for _, rs in loaded for r in rs]
    if len(rows) < 2:
        raise SystemExit(f"error: {', '.join(paths)}: {len(rows)} timed layouts; fit needs 2 or more (run sweep)")
    held = [r for p in a.held_out or [] for r in _timed_rows(p)[1]]
    os.makedirs(a.out, exist_ok=True)
    report = Report(a.out, "fit", render_fit, plot_fit, record=evaluate(rows, run, held_out_rows=held))
    calibration = Calibration(
        rates=report.record["rates"],
        model=run.model,
        micro_batch_size=run.micro_batch_size,
        global_batch_size=run.global_batch_size,
        lengths=sorted({r["seq_length"] for r in rows}),
        worlds=sorted({r["world"] for r in rows}),
        layouts=sorted({r["layout"] for r in rows}),
        in_sample_max_err=report.record["in_sample_max_err"],
        sweeps=paths,
    )
    calibration.save(os.path.join(a.out, "calibration.json"))
    print(report.write(), end="")
    print(f"wrote {os.path.join(a.out, 'calibration.json')}: use it with --calibration")
    return 0


def render_fit(ev: dict) -> str:
    """The fit's table (``OUT/fit.md``): each layout measured, fitted on all rows, held out; then the
    held-out sweep's rows (a length or world not fitted) where there is one."""
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
    if "held_out_sweep" in ev:
        lines += ["", "Held-out sweep, predicted by the fit on all rows:", ""]
        lines += ["| layout | measured step ms | predicted | error |", "|---" * 4 + "|"]
        lines += [
            f"| {n} | {m * 1e3:.0f} | {p * 1e3:.0f} | {100 * (p - m) / m:+.1f}% |" for n, m, p in ev["held_out_sweep"]
        ]
        lines += ["", f"max |error| held out: {100 * ev['held_out_sweep_max_err']:.1f}%"]
    return "\n".join(lines) + "\n"


def plot_fit(ev: dict, path: str) -> None:
    """Predicted against measured step time, every row (``OUT/fit.png``)."""
    import matplotlib.pyplot as plt  # optional (the plot extra): Report draws only where it is installed

    fig, ax = plt.subplots(figsize=(6, 6))
    for key, label, mark in (("in_sample", "fitted", "o"), ("held_out_sweep", "held-out sweep", "s")):
        pts = ev.get(key, [])
        ax.scatter([m * 1e3 for _, m, _ in pts], [p * 1e3 for *_, p in pts], marker=mark, label=label)
    top = max(max(m, p) for key in ("in_sample", "held_out_sweep") for _, m, p in ev.get(key, [])) * 1e3 * 1.1
    ax.plot([0, top], [0, top], "k:", lw=1)
    for f in (0.8, 1.2):
        ax.plot([0, top], [0, top * f], color="0.8", lw=1)
    ax.set(xlabel="measured step ms", ylabel="predicted step ms", xlim=(0, top), ylim=(0, top))
    ax.set_title("step-time model: predicted vs measured (grey: +-20%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
