"""tools/gpu_model_check.py, the GPU check's model part, smoke-run on the CPU at small sizes: every
section runs against the package's and Megatron's current APIs, and the losses section reproduces
the committed CPU losses the GPU run is compared with (same weights, same batches)."""

import json

import pytest

from tests.helpers import run_tool


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path):
    proc = run_tool("tools/gpu_model_check.py", "--device", "cpu", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_model.json").read_text())
    assert len(res["losses"]) == 5 and all(r["rel"] is not None and r["rel"] < 1e-5 for r in res["losses"])
    speed = {r["variant"]: r for r in res["speed"]}
    assert speed["ulysses-local"]["tokens_per_s"] > 0 and "CUDA" in speed["megatron-local"]["skipped"]
    assert res["profile"][0]["event"].startswith("GEMMs:") and [r["seq"] for r in res["lengths"]] == [256, 512]
    assert "failed" not in (tmp_path / "gpu_model.md").read_text()
