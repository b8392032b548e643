"""ulysses-mcore sweep / fit / predict (ulysses_mcore.cli.scaling): a real 2-layout sweep (resumable,
fitted), bad layouts named, the predict command's ranking.  The model itself: tests/test_step_time.py."""

import json
import os
import subprocess
import sys

import pytest

from ulysses_mcore.cli import fit, scaling, sweep
from ulysses_mcore.planning.step_time import Run
from ulysses_mcore.topology import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.spawn
def test_two_layout_sweep_over_two_lengths_measures_resumes_calibrates_and_predicts(tmp_path, capsys):
    """A real sweep of 2 layouts at 256 and 512 tokens (one row each), resumed, fitted into a
    calibration, and predict on that calibration: a line per layout naming it, its tokens/s per GPU
    and how far it extrapolates; the prediction at a calibrated length matches the fit's own."""
    out = str(tmp_path / "sweep")
    argv = ["sweep", "--world", "2", "--out", out, "--iters", "3", "--warmup", "1", "--seq-length", "256,512"]
    argv += ["--layouts", "tp1-u2-cp1-pp1-dp1,tp2-u1-cp1-pp1-dp1"]
    assert scaling.main(argv) == 0
    with open(os.path.join(out, "sweep.json")) as f:
        rec = json.load(f)
    rows = rec["rows"]
    assert rec["settings"]["seq_length"] == [256, 512]
    assert sorted(rows) == [f"{n}@{s}" for n in ("tp1-u2-cp1-pp1-dp1", "tp2-u1-cp1-pp1-dp1") for s in (256, 512)]
    for key, r in rows.items():
        assert key == f"{r['layout']}@{r['seq_length']}"
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["attention_s"] > 0 and r["mlp_s"] > 0
        assert r["optimizer_s"] > 0 and r["peak_gb"] > 0
        assert sum(r[f"{p}_s"] for p in sweep.PHASES) < r["step_s"]  # phases are parts of the step
        assert (r["a2a_bytes"] > 0) == (r["layout"] == "tp1-u2-cp1-pp1-dp1")  # only Ulysses exchanges
    u2 = [rows[f"tp1-u2-cp1-pp1-dp1@{s}"]["a2a_bytes"] for s in (256, 512)]
    assert u2[1] == pytest.approx(2 * u2[0], rel=1e-6)  # bytes grow with the length
    assert os.path.exists(os.path.join(out, "sweep.md")) and os.path.exists(os.path.join(out, "sweep.png"))
    before = os.path.getmtime(os.path.join(out, "tp1-u2-cp1-pp1-dp1@512", "metrics.csv"))
    assert scaling.main(argv) == 0  # resumed: nothing runs again
    assert os.path.getmtime(os.path.join(out, "tp1-u2-cp1-pp1-dp1@512", "metrics.csv")) == before
    with pytest.raises(SystemExit, match="sweep of other settings .*seq_length \\[256, 512\\] there vs 256 now"):
        scaling.main(["sweep", "--world", "2", "--out", out, "--seq-length", "256", "--layouts", "tp1-u2-cp1-pp1-dp1"])

    capsys.readouterr()
    assert scaling.main(["fit", "--out", out]) == 0
    with open(os.path.join(out, "calibration.json")) as f:
        cal = json.load(f)
    assert cal["lengths"] == [256, 512] and cal["worlds"] == [2] and cal["model"] == "tiny"
    ev = fit.evaluate([dict(r) for r in rows.values()], Run("tiny", 256, 1, 4))
    assert [n for n, *_ in ev["in_sample"]] == sorted(rows)
    # how well the model fits live timings is the benchmark's finding (docs/scaling.md), not asserted here:
    # the calibration records the error the evaluation of the same rows computes
    assert cal["in_sample_max_err"] == pytest.approx(ev["in_sample_max_err"], rel=1e-6)
    capsys.readouterr()
    cal_path = os.path.join(out, "calibration.json")
    assert (
        scaling.main(["predict", "--calibration", cal_path, "--model", "tiny", "--seq-length", "512"] + ["--gpus", "2"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    for n in ("tp1-u2-cp1-pp1-dp1", "tp2-u1-cp1-pp1-dp1"):
        line = next(ln for ln in lines if n in ln)
        assert "tokens/s per GPU" in line and "inside the calibration" in line, line
        predicted = {k: p for k, _, p in ev["in_sample"]}[f"{n}@512"]
        assert f"step {predicted:.2f} s" in line  # predict prices a calibrated length as the fit did
    assert (
        scaling.main(["predict", "--calibration", cal_path, "--model", "tiny", "--seq-length", "2048", "--gpus", "4"])
        == 0
    )
    far = capsys.readouterr().out
    assert "extrapolates 4.0x beyond the calibrated lengths 256,512 and 2x the largest calibrated world 2" in far


def test_calibration_files_that_cannot_be_read_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for path, needle in ((tmp_path / "none.json", "no such file"), (bad, "not a calibration")):
        with pytest.raises(SystemExit, match=f"--calibration {path}: {needle}.*ulysses-mcore fit --out DIR"):
            scaling.main(
                ["predict", "--calibration", str(path), "--model", "tiny", "--seq-length", "512", "--gpus", "2"]
            )
    with pytest.raises(SystemExit):
        scaling.main(["sweep", "--world", "2", "--out", str(tmp_path), "--seq-length", "512,x"])


def test_bad_layouts_are_named():
    with pytest.raises(SystemExit, match="tp1-u16-cp1-pp1-dp1: not a layout of 2 ranks"):
        scaling.main(["sweep", "--world", "2", "--out", "/nonexistent", "--layouts", "tp1-u16-cp1-pp1-dp1"])
    with pytest.raises(SystemExit, match="tp8-u1-cp1-pp1-dp1: --tensor-model-parallel-size 8"):
        scaling.main(["sweep", "--world", "8", "--out", "/nonexistent", "--layouts", "tp8-u1-cp1-pp1-dp1"])
    with pytest.raises(SystemExit, match="no layout of 3 ranks runs tiny"):
        scaling.main(["sweep", "--world", "3", "--out", "/nonexistent"])
    with pytest.raises(ValueError, match="tpT-uU-cpC-ppP-dpD"):
        Topology.parse("tp2xu4")


def test_predict_cli_prints_the_best_layouts():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ulysses_mcore",
            "predict",
            "--model",
            "llama8b",
            "--seq-length",
            "131072",
            "--gpus",
            "8,64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "    8 GPUs" in r.stdout and "   64 GPUs" in r.stdout and "tokens/s per GPU" in r.stdout
