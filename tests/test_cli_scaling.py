"""ulysses-mcore sweep / fit / predict (ulysses_mcore.cli.scaling): a real 2-layout sweep (resumable,
fitted), bad layouts named, the predict command's ranking.  The model itself: tests/test_step_time.py."""

import json
import os
import subprocess
import sys

import pytest

from ulysses_mcore.cli import scaling, sweep
from ulysses_mcore.planning.step_time import Run
from ulysses_mcore.topology import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.spawn
def test_two_layout_sweep_measures_resumes_and_fits(tmp_path):
    out = str(tmp_path / "sweep")
    argv = ["sweep", "--world", "2", "--out", out, "--iters", "3", "--warmup", "1"]
    argv += ["--layouts", "tp1-u2-cp1-pp1-dp1,tp2-u1-cp1-pp1-dp1"]
    assert scaling.main(argv) == 0
    with open(os.path.join(out, "sweep.json")) as f:
        rec = json.load(f)
    rows = rec["rows"]
    assert sorted(rows) == ["tp1-u2-cp1-pp1-dp1", "tp2-u1-cp1-pp1-dp1"]
    u2, tp2 = rows["tp1-u2-cp1-pp1-dp1"], rows["tp2-u1-cp1-pp1-dp1"]
    for r in (u2, tp2):
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["attention_s"] > 0 and r["mlp_s"] > 0
        assert r["optimizer_s"] > 0 and r["peak_gb"] > 0
        assert sum(r[f"{p}_s"] for p in sweep.PHASES) < r["step_s"]  # phases are parts of the step
    assert u2["a2a_s"] > 0 and u2["a2a_bytes"] > 0 and tp2["a2a_bytes"] == 0  # only Ulysses exchanges
    assert os.path.exists(os.path.join(out, "sweep.md")) and os.path.exists(os.path.join(out, "sweep.png"))
    before = os.path.getmtime(os.path.join(out, "tp1-u2-cp1-pp1-dp1", "metrics.csv"))
    assert scaling.main(argv) == 0  # resumed: nothing runs again
    assert os.path.getmtime(os.path.join(out, "tp1-u2-cp1-pp1-dp1", "metrics.csv")) == before
    ev = scaling.evaluate(list(rows.values()), Run("tiny", 512, 1, 4))
    assert ev["in_sample_max_err"] < 0.15  # the model reproduces the runs it was calibrated on
    with pytest.raises(SystemExit, match="sweep of other settings .*seq_length 512 there vs 256 now"):
        scaling.main(["sweep", "--world", "2", "--out", out, "--seq-length", "256", "--layouts", "tp1-u2-cp1-pp1-dp1"])


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
    assert "    8 GPUs" in r.stdout and "   64 GPUs" in r.stdout and "tokens/s/GPU" in r.stdout
