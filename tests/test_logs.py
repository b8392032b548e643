"""What a run writes (ulysses_mcore.megatron.trainer.logs): metrics.csv's header and rows, and on a
resume the rows after the checkpoint dropped (one row per iteration across resumes)."""

import argparse
import csv

import pytest

from ulysses_mcore.megatron.trainer.logs import MetricsLog, trim_metrics


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_a_resumed_run_continues_metrics_without_repeating_iterations(tmp_path, capsys):
    args = argparse.Namespace(log_dir=str(tmp_path), save=None, load=None)
    log = MetricsLog(args, 0)
    for it in (1, 2, 3, 4):
        log.row(iteration=it, consumed_samples=it * 8, lm_loss="2.0", lr="1e-3", kind="train")
    log.fh.close()
    path = tmp_path / "metrics.csv"
    assert _rows(path)[0] == MetricsLog.COLUMNS and len(_rows(path)) == 5
    assert _rows(path)[1] == ["1", "8", "2.0", "1e-3", "", "", "", "", "train"]  # by name; the rest empty
    resumed = MetricsLog(argparse.Namespace(log_dir=str(tmp_path), save=None, load="ckpt"), 2)
    assert "dropped 2 rows after iteration 2" in capsys.readouterr().out
    resumed.row(iteration=3, consumed_samples=24, lm_loss="1.9", lr="1e-3", kind="train")
    resumed.fh.close()
    assert [r[0] for r in _rows(path)] == ["iteration", "1", "2", "3"]


def test_trim_metrics_keeps_one_row_per_iteration(tmp_path):
    p = tmp_path / "metrics.csv"
    p.write_text("iteration,lm_loss,kind\n1,5.0,train\n2,4.0,train\n2,4.1,valid\n3,3.0,train\n")
    assert trim_metrics(str(p), 2) == 1
    assert p.read_text().splitlines() == ["iteration,lm_loss,kind", "1,5.0,train", "2,4.0,train", "2,4.1,valid"]
    assert trim_metrics(str(tmp_path / "none.csv"), 2) == 0


def test_a_row_names_its_columns(tmp_path):
    log = MetricsLog(argparse.Namespace(log_dir=str(tmp_path), save=None, load=None), 0)
    with pytest.raises(KeyError, match="no column \\['loss'\\]"):
        log.row(iteration=1, loss="2.0")
    log.fh.close()
