"""tools/longest_check.py, the GPU check's longest-sequence step: the plan's dry-run command becomes a
training run of the same flags, and on the CPU (--smoke, a tiny model at a given length) the whole
step runs: plan, train, the table."""

import json

import pytest

from tests.helpers import run_tool
from tools.longest_check import pretrain_argv

DRY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 1000 --tensor-model-parallel-size 1 "
    "--ulysses-degree 1 --bf16 --use-distributed-optimizer --recompute-granularity full --optimizer-cpu-offload "
    "--micro-batch-size 1 --global-batch-size 1 --seq-length 43478602 --max-position-embeddings 43478602 "
    "--world-size 1 --preset h100"
).split()


def test_the_plans_command_becomes_a_training_run_of_the_same_flags():
    argv = pretrain_argv(DRY, 8192, 1, "/tmp/x", on_cpu=False)
    joined = " ".join(argv)
    assert "--world-size" not in argv and "--preset" not in argv and "43478602" not in joined
    assert "--vocab-size 1000" in joined and "--optimizer-cpu-offload --micro-batch-size 1" in joined
    assert "--seq-length 8192 --max-position-embeddings 8192 --train-iters 1" in joined
    assert "--optimizer-cpu-offload" not in pretrain_argv(DRY, 8192, 1, "/tmp/x", on_cpu=True)  # refused on a CPU


@pytest.mark.slow
def test_cpu_smoke_plans_trains_and_tables(tmp_path):
    proc = run_tool(
        "tools/longest_check.py", "--out", str(tmp_path), "--smoke", "--seq-length", "1024", "--seconds", "200"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "longest.json").read_text())
    (only,) = rec["tries"]
    assert only["fitted"] and only["seq"] == 1024 and only["peak_gb"] > 0 and only["step_s"] > 0, only
    assert "--offload-activation-checkpoints" in rec["command"] and rec["planned_peak_gb"] > 0
    assert "| 1,024 | yes |" in (tmp_path / "longest.md").read_text()
