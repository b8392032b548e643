"""The step-time model (ulysses_mcore.planning.step_time): the layouts a world can run (against
Topology and the trainer's own checks), the memory budget's pruning, which links a layout's groups
cross, and a fit that recovers known rates."""

import pytest

from ulysses_mcore.megatron.trainer.arguments import layout_problem
from ulysses_mcore.planning.step_time import Run, enumerate_layouts, features, fit, predict
from ulysses_mcore.topology import Topology, TopologyError


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_emitted_layout_constructs_and_no_dropped_one_would(world):
    """Independently of the enumerator: a layout is runnable iff Topology takes it (degrees, heads,
    sequence) and the tiny model's 4 layers split over pp and the batch of 8 over dp."""
    import itertools

    run = Run("tiny", seq_length=512, global_batch_size=8)
    keep, dropped = enumerate_layouts(world, run, accepts=layout_problem)
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
            runnable.add(Topology.of(tp, u, cp, pp, topo.dp))
    assert set(keep) == runnable
    assert set(keep).isdisjoint(Topology.parse(n) for n in dropped)
    if world == 8:
        assert "tp8-u1-cp1-pp1-dp1" in dropped  # 4 kv heads cannot split over tp 8


def test_budget_prunes_and_nothing_fitting_is_an_error():
    run = Run(
        "llama8b", seq_length=131072, global_batch_size=8, bf16=True, recompute="full", distributed_optimizer=True
    )
    keep, dropped = enumerate_layouts(8, run, budget_gb=141, accepts=layout_problem)
    assert keep and any("--budget-gb 141" in why for why in dropped.values())
    with pytest.raises(
        ValueError, match="no layout of 8 ranks runs llama8b at --seq-length 1048576 within --budget-gb 1"
    ):
        enumerate_layouts(8, Run("llama8b", seq_length=1048576, global_batch_size=8, bf16=True), budget_gb=1)


def test_links_follow_the_rank_order():
    lay = Topology.of(tp=2, ulysses=4, cp=2, pp=1, dp=1)  # 16 ranks, 8 a node: tp x ulysses inside, the ring across
    assert not lay.crosses_nodes("tp", 8) and not lay.crosses_nodes("ulysses", 8) and lay.crosses_nodes("cp", 8)
    f = features(Run("llama8b", 131072, 1, 16, bf16=True), lay, gpus_per_node=8)
    assert f["a2a_bytes_intra"] > 0 and f.get("a2a_bytes_inter", 0) == 0 and f["ring_bytes_inter"] > 0


def test_fit_recovers_known_rates():
    """Rows made from known rates (plus nothing else) give those rates back, and predictions equal."""
    run = Run("tiny", 512, 1, 8)
    keep, _ = enumerate_layouts(4, run, accepts=layout_problem)
    from ulysses_mcore.planning.step_time import PHASE_TERMS

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


def _rows(rates, run, layouts, lengths):
    """Sweep rows made from known ``rates``: every layout at every length, phases as measured."""
    from dataclasses import replace

    rows = []
    for seq in lengths:
        for lay in layouts:
            p = predict(rates, replace(run, seq_length=seq), lay)
            phases = {f"{k}_s": v for k, v in p.items() if k != "step_s"}
            rows.append(dict(layout=lay.name, seq_length=seq, step_s=p["step_s"], **phases))
    return rows


def test_two_lengths_separate_fixed_per_token_and_per_pair_costs_one_length_cannot():
    """Fitted on rows at 512 and 1024 tokens made from known rates, the model predicts 4096 exactly;
    fitted at 1024 alone it cannot tell the per-pair cost from the per-token one and misses 4096."""
    from ulysses_mcore.planning.step_time import PHASE_TERMS

    run = Run("tiny", 512, 1, 4)
    keep, _ = enumerate_layouts(2, run, accepts=layout_problem)
    true = {p: dict.fromkeys(terms, 0.0) for p, terms in PHASE_TERMS.items()}
    true["attention"].update(attn_flops=5e-11, attn_rows=2e-7, layer_calls=1e-4)
    true["mlp"].update(mlp_flops=2e-11, layer_calls=5e-5)
    true["a2a"].update(a2a_msgs=1e-4, a2a_bytes_intra=3e-9)
    true["optimizer"].update(params=1e-8)
    true["rest"].update(const=0.01, micro_batches=2e-3, other_flops=2e-11, tokens=1e-6, layer_calls=3e-4)
    far = _rows(true, run, keep, [4096])
    two = fit(_rows(true, run, keep, [512, 1024]), run)
    one = fit(_rows(true, run, keep, [1024]), run)
    for r in far:
        lay, at = Topology.parse(r["layout"]), Run("tiny", 4096, 1, 4)
        assert predict(two, at, lay)["step_s"] == pytest.approx(r["step_s"], rel=1e-6)
    worst = max(
        abs(predict(one, Run("tiny", 4096, 1, 4), Topology.parse(r["layout"]))["step_s"] / r["step_s"] - 1) for r in far
    )
    assert worst > 0.05, worst


def test_the_placement_prices_a_document_with_the_step_models_counts():
    """One document filling a micro-batch at degree U on U ranks: the placement's per-rank cost of its
    attention pairs and of its exchange equals the step-time model's attention and all-to-all phases
    for that layout (one count of FLOPs and bytes, two readers)."""
    from ulysses_mcore.planning.placement import Costs
    from ulysses_mcore.planning.shape import MODELS

    rates = {"attention": {"attn_flops": 5e-11}, "a2a": {"a2a_bytes_intra": 3e-9}, "mlp": {}, "rest": {}}
    for u in (2, 4):
        run, lay = Run("tiny", 1024, 1, 1), Topology.of(1, u, 1, 1, 1)  # one micro-batch
        p = predict({**rates, "ring": {}, "optimizer": {}}, run, lay)
        c = Costs.from_rates(rates, MODELS["tiny"])
        assert c.pair * 1024 * 1025 / 2 / u == pytest.approx(p["attention"], rel=1e-12)
        assert c.exchanged * 1024 * (u - 1) / u / u == pytest.approx(p["a2a"], rel=1e-12)
