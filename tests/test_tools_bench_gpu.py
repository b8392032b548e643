"""tools/bench_gpu.py, the GPU check's benchmark, smoke-run on the CPU at small sizes: every
section runs the package's current API (a GPU lease must never end on a function that is gone),
and each section's results are on disk as soon as it finishes."""

import json

import pytest

from tests.helpers import run_tool


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_section(tmp_path):
    proc = run_tool("tools/bench_gpu.py", "--device", "cpu", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    sdpa = [r for r in res["kernels"] if r.get("kernel") == "sdpa" and "ms" in r]
    assert [r["seq"] for r in sdpa] == [256, 512] and all(r["ms"] > 0 for r in sdpa)
    assert [r["P"] for r in res["copies"]] == [2, 4, 8] and all(r["pack_ms"] > 0 for r in res["copies"])
    assert [r["seq"] for r in res["memory"]] == [256, 512]  # the GPTModel step ran (peak memory: CUDA only)
    md = (tmp_path / "gpu_bench.md").read_text()
    assert md.count("## ") == 3 and "skipped: failed" not in md


def test_sections_are_written_as_they_finish(tmp_path):
    """The report is on disk after each section; a failing section is a row and the next one runs."""
    import torch

    from tools import bench_gpu

    report = bench_gpu.Report(str(tmp_path), "gpu_bench", "t", bench_gpu.TABLES, torch.device("cpu"))
    seen = []

    def boom():
        seen.append((tmp_path / "gpu_bench.md").read_text())  # the first section is already written
        raise RuntimeError("boom")

    rows = [{"kernel": "sdpa", "seq": 8, "ms": 1.0, "tflops": 0.1}]
    assert report.run([("kernels", lambda: rows), ("copies", boom), ("memory", lambda: [])]) == 1
    assert "| sdpa | 8 | 1.00 | 0.1 |" in seen[0]
    md = (tmp_path / "gpu_bench.md").read_text()
    assert "skipped: failed: RuntimeError: boom" in md and md.count("## ") == 3
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["kernels"][0]["seq"] == 8
