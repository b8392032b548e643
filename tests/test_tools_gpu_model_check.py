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
    assert speed["baseline-sdpa"]["vs_baseline"] == 1.0 and "CUDA" in speed["megatron-local"]["skipped"]
    for name in ("ulysses-sdpa", "ulysses-sdpa + chunked loss"):
        assert speed[name]["tokens_per_s"] > 0 and speed[name]["step_tflop"] > 0 and 0 < speed[name]["mfu"]
    assert res["profile"][0]["event"].startswith("GEMMs:") and [r["seq"] for r in res["lengths"]] == [256, 512]
    assert "failed" not in (tmp_path / "gpu_model.md").read_text()


def test_tokens_per_second_come_from_the_steps_actually_timed(monkeypatch):
    """5 steps of 0.02 s, the first 3 untimed: 2 timed steps of 100 tokens in about 0.04 s."""
    import time

    from tools import gpu_model_check as g
    from ulysses_mcore.megatron.trainer import training

    monkeypatch.setattr(training, "train_step", lambda *a, **k: (time.sleep(0.02), {"loss": 1.0})[1])
    losses, secs, timed = g.steps(None, None, [None] * 5, 100, g.torch.device("cpu"))
    assert len(losses) == 5 and timed == 2 and 0.04 <= secs < 0.2
    assert g.tokens_per_s(100, secs, timed) == pytest.approx(200 / secs)
