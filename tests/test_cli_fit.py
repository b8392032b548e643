"""ulysses-mcore fit (ulysses_mcore.cli.fit): rows of several lengths fitted and held out by layout
and by sweep, the committed fit re-rendered, the committed calibrations re-fitted from their sweeps
unchanged.  A real sweep fitted and predicted from: tests/test_cli_scaling.py."""

import json
from pathlib import Path

import pytest

from ulysses_mcore.devtools import bench
from ulysses_mcore.cli import fit, scaling, sweep
from ulysses_mcore.planning.step_time import Run, enumerate_layouts, predict
from ulysses_mcore.topology import Topology

PERF = Path(__file__).resolve().parents[1] / "docs" / "perf"


def test_the_committed_fit_rerenders_from_its_record_unchanged():
    record = PERF / "sweep_w4" / "fit"
    assert bench.rerender(str(record), fit.render_fit) == record.with_suffix(".md").read_text()


def test_rows_of_several_lengths_are_named_by_length_and_a_held_out_sweep_is_scored():
    """Rows made by known rates at 512 and 1024: fitted back exactly, named layout@length; a 2048
    sweep held out is predicted exactly too (the rates are the model's own)."""
    from ulysses_mcore.megatron.trainer.arguments import layout_problem
    from ulysses_mcore.planning.step_time import PRESETS, gpu_rates

    rates = gpu_rates(PRESETS["h200"])
    run = Run("tiny", 512, 1, 4)
    keep, _ = enumerate_layouts(4, run, accepts=layout_problem)  # 15 layouts: more rows than any phase has terms

    def rows(seq):
        out = []
        for lay in keep:
            p = predict(rates, Run("tiny", seq, 1, 4), lay)
            phases = {f"{k}_s": v for k, v in p.items() if k != "step_s"}
            out.append(dict(layout=lay.name, seq_length=seq, world=4, step_s=p["step_s"], **phases))
        return out

    ev = fit.evaluate(rows(512) + rows(1024), run, held_out_rows=rows(2048))
    assert {n for n, *_ in ev["in_sample"]} == {f"{lay.name}@{s}" for lay in keep for s in (512, 1024)}
    assert ev["in_sample_max_err"] < 1e-6 and ev["held_out_sweep_max_err"] < 1e-6
    assert [n for n, *_ in ev["held_out_sweep"]] == [f"{lay.name}@2048" for lay in keep]
    text = fit.render_fit(ev)
    assert "Held-out sweep, predicted by the fit on all rows:" in text and "max |error| held out: 0.0%" in text
    assert Topology.parse(ev["in_sample"][0][0].split("@")[0])


def test_sweeps_of_other_runs_are_not_fitted_together(tmp_path):
    for name, gb in (("a", 4), ("b", 8)):
        rec = {"settings": dict(model="tiny", seq_length=512, micro_batch_size=1, global_batch_size=gb), "rows": {}}
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    with pytest.raises(SystemExit, match="timed layouts; fit needs 2 or more"):
        scaling.main(["fit", "--out", str(tmp_path), "--sweep", str(tmp_path / "a.json")])
    both = ["--sweep", str(tmp_path / "a.json"), "--sweep", str(tmp_path / "b.json")]
    with pytest.raises(SystemExit, match="are of other runs \\(global_batch_size 4 vs 8\\): fit one model"):
        scaling.main(["fit", "--out", str(tmp_path), *both])
    with pytest.raises(SystemExit, match="--sweep .*nothing.json: cannot read it"):
        scaling.main(["fit", "--out", str(tmp_path), "--sweep", str(tmp_path / "nothing.json")])


CALIBRATIONS = sorted(p.parent for p in PERF.glob("calibration_w*/calibration.json"))


@pytest.mark.parametrize("folder", CALIBRATIONS, ids=[p.name for p in CALIBRATIONS])
def test_the_committed_calibrations_refit_from_their_sweeps_unchanged(folder, tmp_path):
    """docs/perf/calibration_w*: each sweep's table re-renders from its record, and fitting the
    committed sweeps again gives the committed fit (table) and calibration (rates) exactly."""
    for part in ("cal", "held"):
        assert bench.rerender(str(folder / part / "sweep"), sweep.render) == (folder / part / "sweep.md").read_text()
    argv = ["fit", "--out", str(tmp_path), "--sweep", str(folder / "cal" / "sweep.json")]
    assert scaling.main(argv + ["--held-out", str(folder / "held" / "sweep.json")]) == 0
    assert (tmp_path / "fit.md").read_text() == (folder / "fit.md").read_text()
    mine, committed = (json.loads((d / "calibration.json").read_text()) for d in (tmp_path, folder))
    for phase, rates in committed["rates"].items():
        assert mine["rates"][phase] == pytest.approx(rates, rel=1e-9, abs=1e-15), phase
    assert mine["lengths"] == committed["lengths"] and mine["layouts"] == committed["layouts"]
    assert committed["sweeps"] == [f"docs/perf/{folder.name}/cal/sweep.json"]
