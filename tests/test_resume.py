"""Resuming (ulysses_mcore.megatron.trainer.resume): the latest-iteration file read or refused by
name.  Whole save / kill / resume runs:
tests/test_reliability.py."""

import pytest

from ulysses_mcore.megatron.trainer.checkpoint import CheckpointError, latest_file
from ulysses_mcore.megatron.trainer.resume import _read_latest


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
