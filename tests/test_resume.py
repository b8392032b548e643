"""Resuming (ulysses_mcore.megatron.trainer.resume): the latest-iteration file read or refused by
name, and the metrics trimmed back to the resumed iteration.  Whole save / kill / resume runs:
tests/test_reliability.py."""

import pytest

from ulysses_mcore.megatron.trainer.checkpoint import CheckpointError, latest_file
from ulysses_mcore.megatron.trainer.resume import _read_latest, trim_metrics


def test_latest_iteration_file(tmp_path):
    with pytest.raises(CheckpointError, match="is it a checkpoint directory"):
        _read_latest(str(tmp_path))
    with open(latest_file(str(tmp_path)), "w") as f:
        f.write("garbage")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        _read_latest(str(tmp_path))
    with open(latest_file(str(tmp_path)), "w") as f:
        f.write("12\n")
    assert _read_latest(str(tmp_path)) == 12


def test_trim_metrics_keeps_one_row_per_iteration(tmp_path):
    p = tmp_path / "metrics.csv"
    p.write_text("iteration,lm_loss,kind\n1,5.0,train\n2,4.0,train\n2,4.1,valid\n3,3.0,train\n")
    assert trim_metrics(str(p), 2) == 1
    assert p.read_text().splitlines() == ["iteration,lm_loss,kind", "1,5.0,train", "2,4.0,train", "2,4.1,valid"]
    assert trim_metrics(str(tmp_path / "none.csv"), 2) == 0
