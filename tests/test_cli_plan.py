"""ulysses-mcore plan: the memory model's numbers as the command prints them, and its JSON."""

import json

from ulysses_mcore.cli import plan
from ulysses_mcore.planning.memory_model import estimate

FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096"]


def test_json_is_the_models_estimate_and_the_budget_search(capsys):
    assert plan.main([*FLAGS, "--ulysses", "2", "--budget-gb", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = estimate(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=4096, ulysses=2)
    assert out["estimate"] == want
    assert set(out["longest_sequence"]) == {"1", "2", "4", "8"}  # degrees dividing the 8 heads
    assert int(out["longest_sequence"]["8"]) >= int(out["longest_sequence"]["1"]) > 0


def test_text_report(capsys):
    assert plan.main([*FLAGS, "--ulysses", "4", "--cp", "2"]) == 0
    text = capsys.readouterr().out
    assert "per rank at seq 4096, tp 1 x ulysses 4 x cp 2 x pp 1:" in text
    assert "tokens per rank 512;" in text and "ring shifts" in text
