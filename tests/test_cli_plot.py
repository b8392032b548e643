"""ulysses-mcore plot: the trainer's metrics.csv (train and valid rows) into a PNG; a missing file
is a clear error.  (With a real training run's CSV: tests/test_pretrain.py.)"""

from ulysses_mcore.cli import plot


def test_draws_a_png_from_metrics_csv(tmp_path):
    csv = tmp_path / "metrics.csv"
    rows = ["iteration,lm_loss,tokens_per_second,kind"]
    rows += [f"{i},{5 - i / 10},{1000 + i},train" for i in range(1, 11)] + ["10,4.2,0,valid"]
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "t.png"
    assert plot.main([str(csv), "--out", str(out), "--label", "run"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_csv_is_named(tmp_path, capsys):
    assert plot.main([str(tmp_path / "none.csv"), "--out", str(tmp_path / "t.png")]) == 2
    assert "none.csv does not exist" in capsys.readouterr().err
