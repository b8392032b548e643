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
        assert speed[name]["kernel"].startswith("torch sdpa") and speed[name]["mfu_datasheet"] is None  # a CPU
    # the analytic FLOPs against what torch's FlopCounterMode counted in a real step (an independent count)
    assert speed["ulysses-sdpa"]["analytic_tflop"] == pytest.approx(speed["ulysses-sdpa"]["step_tflop"], rel=0.05)
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


def test_a_failing_variant_is_its_own_row_and_the_table_is_kept(monkeypatch):
    from tools import gpu_model_check as g

    def measure(name, *a):
        if name == "ulysses-sdpa":
            raise RuntimeError("CUDA error: an illegal memory access")
        return {"variant": name, "tokens_per_s": 100.0, "peak_gb": 2.0, "step_s": 0.5, "step_tflop": 1.0}

    monkeypatch.setattr(g, "_measure", measure)
    rows = {r["variant"]: r for r in g.section_speed(g.torch.device("cpu"), True, bf16_tflops=10.0)}
    assert "failed: RuntimeError: CUDA error: an illegal memory access" in rows["ulysses-sdpa"]["skipped"]
    assert rows["ulysses-sdpa"]["torch"] == g.torch.__version__  # versions on the failed row too
    base = rows["baseline-sdpa"]
    assert base["vs_baseline"] == 1.0 and base["mfu"] == pytest.approx(base["analytic_tflop"] / 0.5 / 10.0)


def test_datasheet_peaks_by_device_name():
    from tools.gpu_model_check import datasheet_tflops

    assert datasheet_tflops("NVIDIA H100 80GB HBM3") == 989 and datasheet_tflops("NVIDIA A100-SXM4-80GB") == 312
    assert datasheet_tflops("NVIDIA H200") == 989 and datasheet_tflops("Tesla T4") is None
