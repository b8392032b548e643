"""ulysses-mcore plan: the memory model's numbers as the command prints them, and its JSON."""

import json

import pytest

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


def test_budget_with_a_calibration_prices_each_longest_sequence(tmp_path, capsys):
    """--calibration beside --budget-gb: each degree's longest sequence with its tokens/s per GPU by
    the calibration's rates (the step-time model's prediction at that length) and how far it reaches."""
    from ulysses_mcore.planning.calibration import Calibration
    from ulysses_mcore.planning.shape import ModelShape
    from ulysses_mcore.planning.step_time import PRESETS, Run, gpu_rates, predict
    from ulysses_mcore.topology import Topology

    rates = gpu_rates(PRESETS["h200"])
    path = str(tmp_path / "calibration.json")
    Calibration(rates, "tiny", 1, 2, [512, 1024], [2], ["tp1-u2-cp1-pp1-dp1"], 0.02).save(path)
    assert plan.main([*FLAGS, "--budget-gb", "1", "--calibration", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for u, seq in out["longest_sequence"].items():
        run = Run(ModelShape(4, 256, 8), seq, 1, 1)
        want = seq / predict(rates, run, Topology.of(1, int(u), 1, 1, 1))["step_s"] / int(u)
        tps, reach = out["tokens_per_s_per_gpu"][u]
        assert tps == pytest.approx(want) and reach.startswith("extrapolates")
    assert plan.main([*FLAGS, "--budget-gb", "1", "--calibration", path]) == 0
    assert "tokens/s per GPU, extrapolates" in capsys.readouterr().out


def test_longest_takes_megatron_lms_model_flags_and_ends_with_the_dry_run(capsys):
    """plan --longest: the longest sequence with its layout and memory flags, the host memory a node, and
    on its last line the dry run of that plan with the model flags as given (Megatron-LM's names)."""
    model = "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8"
    model += " --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights"
    model += " --vocab-size 128256"
    assert plan.main(["--longest", "--preset", "h100", "--world-size", "8", *model.split()]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("longest sequence on 8 x h100 (80 GB, 8% left to the allocator: 73.6 GB a GPU): ")
    assert any(ln.strip().startswith("memory flags: --bf16 --use-distributed-optimizer") for ln in lines)
    assert any("GB a node" in ln for ln in lines)
    seq = int(lines[0].rsplit(": ", 1)[1].split()[0].replace(",", ""))
    assert lines[-1].startswith("ulysses-mcore dryrun " + model)
    assert f"--seq-length {seq} " in lines[-1] and lines[-1].endswith("--world-size 8 --preset h100")


def test_longest_with_bf16_gradients_plans_longer_and_passes_the_flag_on(capsys):
    """--grad-reduce-in-bf16 is the user's choice: the plan keeps it in its memory flags and its dry run
    command, and the halved gradient buffer leaves room for a longer sequence; without --longest it
    needs --bf16."""
    model = "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 14336"
    model += " --swiglu --vocab-size 128256 --untie-embeddings-and-output-weights"
    longest = {}
    for extra in ([], ["--grad-reduce-in-bf16"]):
        assert plan.main(["--longest", "--world-size", "1", *model.split(), *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        longest[bool(extra)] = int(lines[0].rsplit(": ", 1)[1].split()[0].replace(",", ""))
        flags = next(ln for ln in lines if ln.strip().startswith("memory flags:"))
        assert ("--grad-reduce-in-bf16" in flags) == bool(extra)
        assert ("--grad-reduce-in-bf16" in lines[-1]) == bool(extra)
    assert longest[True] > 1.5 * longest[False]
    with pytest.raises(SystemExit, match="--grad-reduce-in-bf16 keeps bf16 gradients of bf16 weights: add --bf16"):
        plan.main([*FLAGS, "--grad-reduce-in-bf16"])


def test_longest_without_linear_biases_plans_longer_at_ulysses_1_only_and_passes_the_flag_on(capsys):
    """--disable-bias-linear: the recomputed layer's bias-dropout-add holds one [s, h] less, which the
    plan counts where that phase holds the peak (ulysses 1: one GPU); the dry run's command keeps it."""
    model = "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 14336"
    model += " --swiglu --vocab-size 128256 --untie-embeddings-and-output-weights"
    longest = {}
    for world in ("1", "8"):
        for extra in ([], ["--disable-bias-linear"]):
            assert plan.main(["--longest", "--world-size", world, *model.split(), *extra]) == 0
            lines = capsys.readouterr().out.splitlines()
            longest[world, bool(extra)] = int(lines[0].rsplit(": ", 1)[1].split()[0].replace(",", ""))
            assert ("--disable-bias-linear" in lines[-1]) == bool(extra)
    assert longest["1", True] > 1.05 * longest["1", False]
    assert longest["8", True] == longest["8", False]  # ulysses > 1: the attention phase may hold the peak


def test_longest_needs_a_world_size():
    with pytest.raises(SystemExit, match="--world-size"):
        plan.main(["--longest", *FLAGS])
