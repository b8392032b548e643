"""ulysses-mcore sweep (ulysses_mcore.cli.sweep): the layouts Megatron-LM's script cannot run here
dropped with the reason, the sweep folder refused for other settings, and the committed sweep's
table re-rendered from its record unchanged.  A real sweep: tests/test_cli_scaling.py."""

import json
from pathlib import Path

import pytest

from ulysses_mcore.devtools import bench
from ulysses_mcore.cli import sweep
from ulysses_mcore.megatron.trainer.arguments import layout_problem
from ulysses_mcore.planning.step_time import Run, enumerate_layouts

SWEEP = Path(__file__).resolve().parents[1] / "docs" / "perf" / "sweep_w4" / "sweep"


def test_megatron_lm_sweeps_skip_rings_with_the_reason():
    """Megatron-LM's script cannot run a ring without TE (a CPU sweep): those layouts are dropped with
    the reason instead of failing the sweep; on a GPU they stay."""
    layouts, _ = enumerate_layouts(4, Run("tiny", 512, 1, 4), accepts=layout_problem)
    assert any(lay.cp > 1 for lay in layouts)
    dropped = {}
    kept = sweep.runnable_by_megatron_lm(layouts, dropped, on_gpu=False)
    assert kept and all(lay.cp == 1 for lay in kept) and len(kept) + len(dropped) == len(layouts)
    assert all("TEDotProductAttention" in why for why in dropped.values())
    assert sweep.runnable_by_megatron_lm(layouts, {}, on_gpu=True) == layouts


def test_the_committed_sweep_rerenders_from_its_record_unchanged():
    assert bench.rerender(str(SWEEP), sweep.render) == SWEEP.with_suffix(".md").read_text()


def test_a_folder_of_other_settings_is_refused(tmp_path):
    settings = {"model": "tiny", "seq_length": 512, "world": 2}
    (tmp_path / "sweep.json").write_text(json.dumps({"settings": settings, "rows": {}}))
    assert sweep.open_sweep(str(tmp_path), settings)["settings"] == settings
    with pytest.raises(SystemExit, match="world 2 there vs 4 now"):
        sweep.open_sweep(str(tmp_path), dict(settings, world=4))
