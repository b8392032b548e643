"""ulysses_mcore.megatron.trainer.checkpoint: what can be checked without a world -- the latest-iteration
file, the schedule a command line asks for, one metrics row per iteration across resumes.  Saving,
damage detection and resuming run in spawned worlds: tests/test_catalogue.py, tests/test_reliability.py."""

import argparse

import pytest

from ulysses_mcore.megatron.trainer.checkpoint import (
    CheckpointError,
    _read_latest,
    latest_file,
    schedule_from_flags,
    trim_metrics,
)


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


def test_schedule_counts_samples():
    a = argparse.Namespace(
        global_batch_size=8,
        lr=1e-3,
        min_lr=1e-4,
        lr_warmup_iters=2,
        train_iters=10,
        lr_decay_style="cosine",
        weight_decay=0.1,
    )
    s = schedule_from_flags(a)
    assert (s["lr_warmup_steps"], s["lr_decay_steps"], s["max_lr"]) == (16, 80, 1e-3)


def test_trim_metrics_keeps_one_row_per_iteration(tmp_path):
    p = tmp_path / "metrics.csv"
    p.write_text("iteration,lm_loss,kind\n1,5.0,train\n2,4.0,train\n2,4.1,valid\n3,3.0,train\n")
    assert trim_metrics(str(p), 2) == 1
    assert p.read_text().splitlines() == ["iteration,lm_loss,kind", "1,5.0,train", "2,4.0,train", "2,4.1,valid"]
    assert trim_metrics(str(tmp_path / "none.csv"), 2) == 0
