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
