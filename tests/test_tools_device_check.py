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


def _check(out, script="tools/device_check.sh", **env):
    inherited = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}  # a world of this process's
    env = dict(inherited, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    cmd = ["bash", script, str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_cpu_smoke_leaves_two_files_with_every_steps_results(tmp_path):
    proc = _check(tmp_path / "out", DEVICE_CHECK_CPU="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["results.tar.gz", "summary.txt"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "model        rc=0" in summary and "pretrain     rc=0" in summary, summary
    assert "longest      rc=0" in summary and "| 1,024 | yes |" in summary, summary  # the plan's flags, trained
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = set(tar.getnames())
        model = json.load(tar.extractfile("device_check/gpu_model.json"))
        longest = json.load(tar.extractfile("device_check/longest.json"))
    assert longest["tries"][0]["fitted"] and "--recompute-granularity full" in longest["command"]
    assert {"device_check/env.txt", "device_check/pretrain.txt", "device_check/gpu_model.md"} <= names
    assert not any("/run/data/" in n for n in names)  # the trainer's index caches stay out
    speed = {r["variant"]: r for r in model["speed"]}
    assert speed["baseline-sdpa"]["vs_baseline"] == 1.0 and speed["ulysses-sdpa + chunked loss"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_node_check_cpu_smoke_measures_the_all_to_all_and_trains_at_full_degree(tmp_path):
    proc = _check(tmp_path / "out", "tools/device_node_check.sh", DEVICE_CHECK_CPU="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["results.tar.gz", "summary.txt"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "bench_nccl   rc=0" in summary and "pretrain     rc=0" in summary, summary
    assert "megatron_cp  skipped: CPU smoke run" in summary, summary
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        bench = json.load(tar.extractfile("device_check/bench_nccl.json"))
        pretrain = tar.extractfile("device_check/pretrain.txt").read().decode()
    assert [r["mb"] for r in bench["all_to_all"]] == [2**14 / 2**20, 2**18 / 2**20]
    assert all(r["busbw"] > 0 for r in bench["all_to_all"]) and bench["ulysses"][0]["ulysses_ms"] > 0
    assert "ulysses 2" in pretrain and "iteration        2/" in pretrain, pretrain[-2000:]


@pytest.mark.slow
def test_only_the_steps_named_run(tmp_path):
    _check(tmp_path / "out", DEVICE_CHECK_CPU="1", DEVICE_CHECK_STEPS="pretrain")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "pretrain     rc=0" in summary and "model " not in summary and "longest " not in summary, summary


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
