"""tools/bench_dynamic.py: a real tiny run (three trainings at world 2) and its report, and the
report's arithmetic on given numbers."""

import json

import pytest

from tests.helpers import run_tool


@pytest.mark.slow
def test_a_tiny_run_trains_three_modes_and_writes_the_report(tmp_path):
    proc = run_tool(
        "tools/bench_dynamic.py",
        *("--worlds", "2", "--runs", "1", "--iters", "4", "--seq-length", "512", "--documents", "300"),
        *("--mix", "light", "--out", str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench_dynamic_light.json").read_text())
    modes = {r["mode"]: r for r in res["results"]}
    assert set(modes) == {"fixed", "degree 1", "dynamic"}
    assert modes["degree 1"]["a2a_bytes_per_step"] == 0 < modes["dynamic"]["a2a_bytes_per_step"]
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
