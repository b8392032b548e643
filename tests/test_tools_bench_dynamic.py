"""tools/bench_dynamic.py: a real tiny run (four trainings at world 2) and its report, and the
report's arithmetic on given numbers."""

import json

import pytest

from tests.helpers import run_tool


@pytest.mark.slow
def test_a_tiny_run_trains_four_modes_and_writes_the_report(tmp_path):
    proc = run_tool(
        "tools/bench_dynamic.py",
        *("--worlds", "2", "--runs", "1", "--iters", "4", "--seq-length", "512", "--documents", "300"),
        *("--mix", "light", "--out", str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench_dynamic_light.json").read_text())
    modes = {r["mode"]: r for r in res["results"]}
    assert set(modes) == {"fixed", "degree 1", "dynamic", "equal memory"}
    assert modes["degree 1"]["a2a_bytes_per_step"] == 0 < modes["dynamic"]["a2a_bytes_per_step"]
    assert modes["equal memory"]["a2a_bytes_per_step"] == 0 and modes["equal memory"]["a2a_s_per_step"] == 0
    assert modes["dynamic"]["micro_batches_max"] >= 1 and 0 <= modes["dynamic"]["pad_percent"] < 5
    assert modes["fixed"]["micro_batches_max"] is None  # only a dynamic run logs its schedule
    assert modes["dynamic"]["a2a_bytes_per_step"] < modes["fixed"]["a2a_bytes_per_step"]
    for a, b in zip(modes["dynamic"]["losses"], modes["fixed"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert "dynamic:" in modes["dynamic"]["schedule"]
    assert [g["gpus"] for g in res["gpus"]] == [8, 16, 32, 64]
    assert (tmp_path / "bench_dynamic_light.png").stat().st_size > 10_000
    assert "| 2 | 1 |" in (tmp_path / "bench_dynamic_light.md").read_text()


def test_report_says_how_much_of_the_gap_closes(tmp_path):
    from tools.bench_dynamic_report import _summary, render

    def row(mode, tps, a2a):
        return dict(
            world=4, run=0, mode=mode, tokens_per_second=tps, a2a_bytes_per_step=a2a, busy_max_over_mean=1.0,
            peak_gb=1.0, losses=[2.0, 1.0], schedule="",
        )  # fmt: skip

    results = [row("fixed", 100.0, 10.0), row("degree 1", 130.0, 0.0), row("dynamic", 124.0, 4.0)]
    (s,) = _summary(results)
    assert s["closed"] == pytest.approx(0.8) and s["loss_rel_diff"] == 0.0
    assert _summary(results[:2]) == []  # a run still going has no row yet
    gpus = [{"gpus": 8, "fixed": 2.0, "degree 1": 3.0, "dynamic": 1.6}]
    md = render({"setup": {"x": 1}, "results": results, "gpus": gpus})
    assert "| 4 | 1 | 100 | 130 | 124 | 1.240 | 80% | 0.40 |" in md and "| 8 | 2.00 | 3.00 | 1.60 | 1.250 |" in md


def test_the_equal_memory_table_says_how_much_of_the_gap_closes_and_could(tmp_path):
    """Step times 1.0 (fixed), 0.6 (equal memory), 0.8 (dynamic, 0.06 s of all-to-alls, 10 micro-batches
    where fixed runs 8 at 0.02 s each): closed (1.0 - 0.8) / 0.4 = 50%, reachable (1.0 - 0.7) / 0.4 = 75%."""
    from tools.bench_dynamic_report import render

    def row(mode, step, tps, a2a_s=0.0, mbs=None):
        return dict(
            world=4, run=0, mode=mode, tokens_per_second=tps, step_s=step, a2a_bytes_per_step=1.0, a2a_s_per_step=a2a_s,
            micro_batches_max=mbs, pad_percent=0.5 if mbs else None, busy_max_over_mean=1.0, peak_gb=1.0,
            losses=[2.0, 1.0], schedule="",
        )  # fmt: skip

    results = [
        row("fixed", 1.0, 100.0),
        row("degree 1", 0.7, 140.0),
        row("dynamic", 0.8, 125.0, 0.06, 10),
        row("equal memory", 0.6, 160.0),
    ]
    md = render({"setup": {"micro_batch_s": 0.02}, "results": results, "gpus": []})
    assert "| 4 | 1 | 100 | 125 | 1.250 | 160 | 140 | 10, 8 | 0.50% | 50% | 75% | 1.00, 1.00 | 0.0e+00 |" in md, md
    assert "world 4: dynamic / fixed 1.250 median of 1 interleaved runs (spread 1.250-1.250)" in md
    assert render({"setup": {"micro_batch_s": 0.02}, "results": results[:3], "gpus": []}).count("| 4 |") == 0
