"""The benchmark harness (ulysses_mcore.devtools.bench): a report rewritten as each section finishes, a failed
rank named instead of awaited, and every committed table re-rendered from its JSON unchanged."""

import importlib
import json
from pathlib import Path

import pytest

from ulysses_mcore.devtools import bench

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "perf"

# committed record (docs/perf/STEM.json + STEM.md) -> the tool whose render made the table
COMMITTED = {
    "bench_throughput": "bench_throughput",
    "bench_attention_P2": "bench_attention",
    "bench_hybrid_P4": "bench_hybrid",
    "bench_memory": "bench_memory",
    "bench_step_memory": "bench_step_memory",
    "bench_variants": "bench_variants",
    "bench_overhead": "bench_overhead",
    "bench_dynamic_light": "bench_dynamic_report",
    "bench_dynamic_heavy": "bench_dynamic_report",
    "bench_attention_P2_reuse_allocator": "bench_attention",
}


@pytest.mark.parametrize("stem", sorted(COMMITTED))
def test_every_committed_table_rerenders_from_its_json_unchanged(stem):
    render = importlib.import_module(f"tools.{COMMITTED[stem]}").render
    assert bench.rerender(str(PERF / stem), render) == (PERF / f"{stem}.md").read_text()


def test_a_report_is_on_disk_after_each_section(tmp_path):
    def render(rec):
        return "".join(f"| {k} | {v} |\n" for k, v in rec.items())

    drawn = []
    report = bench.Report(str(tmp_path), "demo", render, plot=lambda rec, path: drawn.append(dict(rec)))
    report.section("first", 1)
    assert json.loads((tmp_path / "demo.json").read_text()) == {"first": 1}
    assert (tmp_path / "demo.md").read_text() == "| first | 1 |\n"
    report.section("second", [2, 3])
    assert json.loads((tmp_path / "demo.json").read_text()) == {"first": 1, "second": [2, 3]}
    assert bench.rerender(str(tmp_path / "demo"), render) == (tmp_path / "demo.md").read_text()
    assert not list(tmp_path.glob("*.tmp"))
    pytest.importorskip("matplotlib")
    assert drawn == [{"first": 1}, {"first": 1, "second": [2, 3]}]


def _dies_on_rank_one(rank, world, port, queue):
    if rank == 1:
        raise SystemExit(7)
    queue.put(rank)


def test_a_failed_rank_is_named_not_awaited():
    with pytest.raises(SystemExit, match=r"a demo world failed \(exit codes per rank: \[0, 7\]\)"):
        bench.run_world(2, _dies_on_rank_one, what="a demo world")


def test_progress_counts_every_item():
    assert list(bench.progress(range(5), desc="demo")) == [0, 1, 2, 3, 4]
