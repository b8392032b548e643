"""tools/device_check.sh, the prepared GPU check, smoke-run on the CPU (DEVICE_CHECK_CPU=1): the
output folder holds exactly summary.txt and results.tar.gz (the device machine returns at most 8
files), every step's results are in the archive, the overall deadline skips what would start too
late, and without a GPU (no smoke) it writes nothing."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # set by in-process worlds


def _check(out, **env):
    inherited = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}  # a world of this process's
    env = dict(inherited, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    cmd = ["bash", "tools/device_check.sh", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_cpu_smoke_leaves_two_files_with_every_steps_results(tmp_path):
    proc = _check(tmp_path / "out", DEVICE_CHECK_CPU="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["results.tar.gz", "summary.txt"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "model        rc=0" in summary and "pretrain     rc=0" in summary, summary
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = set(tar.getnames())
        model = json.load(tar.extractfile("device_check/gpu_model.json"))
    assert {"device_check/env.txt", "device_check/pretrain.txt", "device_check/gpu_model.md"} <= names
    assert not any("/run/data/" in n for n in names)  # the trainer's index caches stay out
    speed = {r["variant"]: r for r in model["speed"]}
    assert speed["baseline-sdpa"]["vs_baseline"] == 1.0 and speed["ulysses-sdpa + chunked loss"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_steps_past_the_overall_deadline_are_skipped_and_said(tmp_path):
    proc = _check(tmp_path / "out", DEVICE_CHECK_CPU="1", DEVICE_CHECK_SECONDS="12")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "model        skipped: the overall deadline" in summary, summary
    assert "pretrain     skipped: the overall deadline" in summary, summary
    assert sorted(os.listdir(tmp_path / "out")) == ["results.tar.gz", "summary.txt"], proc.stderr


@pytest.mark.slow
def test_without_a_gpu_it_writes_nothing(tmp_path):
    proc = _check(tmp_path / "out", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "no CUDA GPU" in proc.stderr
    assert not (tmp_path / "out").exists()
