"""tools/scaling.py and tools/scaling_model.py: the layouts a world can run (against Topology and the
trainer's own checks), the sweep (a real 2-layout sweep, resumable), the step-time model, bad input."""

import json
import os
import subprocess
import sys

import pytest

from tools import scaling
from tools.scaling_model import Layout, Run, crosses_nodes, enumerate_layouts, features, fit, predict
from ulysses_mcore.topology import Topology, TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_emitted_layout_constructs_and_no_dropped_one_would(world):
    """Independently of the enumerator: a layout is runnable iff Topology takes it (degrees, heads,
    sequence) and the tiny model's 4 layers split over pp and the batch of 8 over dp."""
    import itertools

    run = Run("tiny", seq_length=512, global_batch_size=8)
    keep, dropped = enumerate_layouts(world, run)
    divs = [d for d in range(1, world + 1) if world % d == 0]
    runnable = set()
    for tp, u, cp, pp in itertools.product(divs, divs, divs, divs):
        if world % (tp * u * cp * pp):
            continue
        try:
            topo = Topology(world, tp=tp, ulysses=u, cp=cp, pp=pp)
            topo.check_model(8, 4, 512)
        except TopologyError:
            continue
        if 4 % pp == 0 and 8 % topo.dp == 0:
            runnable.add(Layout(tp, u, cp, pp, topo.dp))
    assert set(keep) == runnable
    assert set(keep).isdisjoint(Layout.parse(n) for n in dropped)
    if world == 8:
        assert "tp8-u1-cp1-pp1-dp1" in dropped  # 4 kv heads cannot split over tp 8


def test_budget_prunes_and_nothing_fitting_is_an_error():
    run = Run(
        "llama8b", seq_length=131072, global_batch_size=8, bf16=True, recompute="full", distributed_optimizer=True
    )
    keep, dropped = enumerate_layouts(8, run, budget_gb=141)
    assert keep and any("--budget-gb 141" in why for why in dropped.values())
    with pytest.raises(
        ValueError, match="no layout of 8 ranks runs llama8b at --seq-length 1048576 within --budget-gb 1"
    ):
        enumerate_layouts(8, Run("llama8b", seq_length=1048576, global_batch_size=8, bf16=True), budget_gb=1)


def test_links_follow_the_rank_order():
    lay = Layout(tp=2, ulysses=4, cp=2, pp=1, dp=1)  # 16 ranks, 8 a node: tp x ulysses inside, the ring across
    assert not crosses_nodes(lay, "tp", 8) and not crosses_nodes(lay, "ulysses", 8) and crosses_nodes(lay, "cp", 8)
    f = features(Run("llama8b", 131072, 1, 16, bf16=True), lay, gpus_per_node=8)
    assert f["a2a_bytes_intra"] > 0 and f.get("a2a_bytes_inter", 0) == 0 and f["ring_bytes_inter"] > 0


def test_fit_recovers_known_rates():
    """Rows made from known rates (plus nothing else) give those rates back, and predictions equal."""
    run = Run("tiny", 512, 1, 8)
    keep, _ = enumerate_layouts(4, run)
    from tools.scaling_model import PHASE_TERMS

    true = {
        p: {
            t: (3e-10 if "flops" in t else 2e-9 if "bytes" in t else 1e-4 if t.endswith("msgs") else 1e-8)
            for t in terms
        }
        for p, terms in PHASE_TERMS.items()
    }
    rows = []
    for lay in keep:
        p = predict(true, run, lay)
        rows.append(dict(layout=lay.name, step_s=p["step_s"], **{f"{k}_s": v for k, v in p.items() if k != "step_s"}))
    rates = fit(rows, run)
    for lay in keep:
        assert predict(rates, run, lay)["step_s"] == pytest.approx(predict(true, run, lay)["step_s"], rel=1e-6)


@pytest.mark.spawn
def test_two_layout_sweep_measures_resumes_and_fits(tmp_path):
    out = str(tmp_path / "sweep")
    argv = ["sweep", "--world", "2", "--out", out, "--iters", "3", "--warmup", "1"]
    argv += ["--layouts", "tp1-u2-cp1-pp1-dp1,tp2-u1-cp1-pp1-dp1"]
    assert scaling.main(argv) == 0
    with open(os.path.join(out, "sweep.json")) as f:
        rec = json.load(f)
    rows = rec["rows"]
    assert sorted(rows) == ["tp1-u2-cp1-pp1-dp1", "tp2-u1-cp1-pp1-dp1"]
    u2, tp2 = rows["tp1-u2-cp1-pp1-dp1"], rows["tp2-u1-cp1-pp1-dp1"]
    for r in (u2, tp2):
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["attention_s"] > 0 and r["mlp_s"] > 0
        assert r["optimizer_s"] > 0 and r["peak_gb"] > 0
        assert sum(r[f"{p}_s"] for p in scaling.PHASES) < r["step_s"]  # phases are parts of the step
    assert u2["a2a_s"] > 0 and u2["a2a_bytes"] > 0 and tp2["a2a_bytes"] == 0  # only Ulysses exchanges
    assert os.path.exists(os.path.join(out, "sweep.md")) and os.path.exists(os.path.join(out, "sweep.png"))
    before = os.path.getmtime(os.path.join(out, "tp1-u2-cp1-pp1-dp1", "metrics.csv"))
    assert scaling.main(argv) == 0  # resumed: nothing runs again
    assert os.path.getmtime(os.path.join(out, "tp1-u2-cp1-pp1-dp1", "metrics.csv")) == before
    ev = scaling.evaluate(list(rows.values()), Run("tiny", 512, 1, 4))
    assert ev["in_sample_max_err"] < 0.15  # the model reproduces the runs it was calibrated on
    with pytest.raises(SystemExit, match="sweep of other settings .*seq_length 512 there vs 256 now"):
        scaling.main(["sweep", "--world", "2", "--out", out, "--seq-length", "256", "--layouts", "tp1-u2-cp1-pp1-dp1"])


def test_bad_layouts_are_named():
    with pytest.raises(SystemExit, match="tp1-u16-cp1-pp1-dp1: not a layout of 2 ranks"):
        scaling.main(["sweep", "--world", "2", "--out", "/nonexistent", "--layouts", "tp1-u16-cp1-pp1-dp1"])
    with pytest.raises(SystemExit, match="tp8-u1-cp1-pp1-dp1: --tensor-model-parallel-size 8"):
        scaling.main(["sweep", "--world", "8", "--out", "/nonexistent", "--layouts", "tp8-u1-cp1-pp1-dp1"])
    with pytest.raises(SystemExit, match="no layout of 3 ranks runs tiny"):
        scaling.main(["sweep", "--world", "3", "--out", "/nonexistent"])
    with pytest.raises(ValueError, match="tpT-uU-cpC-ppP-dpD"):
        Layout.parse("tp2xu4")


def test_predict_cli_prints_the_best_layouts():
    r = subprocess.run(
        [
            sys.executable,
            "tools/scaling.py",
            "predict",
            "--model",
            "llama8b",
            "--seq-length",
            "131072",
            "--gpus",
            "8,64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "    8 GPUs" in r.stdout and "   64 GPUs" in r.stdout and "tokens/s/GPU" in r.stdout
