"""The placement of ``--dynamic-ulysses`` (pure): every token placed once, no rank over its load,
aligned power-of-two blocks, one global order of group cells, each rank as many micro-batches as its
documents need, priced with a micro-batch's own time and the pad."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ulysses_mcore.planning.mix import long_tailed_lengths
from ulysses_mcore.planning.placement import (
    Costs,
    PlacementError,
    degree_for,
    place,
    samples_of,
    step_times,
)

COSTS = Costs(token=1.0, pair=0.01, exchanged=0.5, cell=3.0)


def check(schedule, lengths, *, ranks, max_ulysses, cap, bucket=1, whole_bucket=1):
    """Every property a schedule must have; raises AssertionError naming the first broken one."""
    cells = schedule.cells()
    placed = sorted(i for c in cells for i in c.docs)
    assert placed == list(range(len(lengths))), "every document exactly once"
    for c in cells:
        assert c.ulysses & (c.ulysses - 1) == 0 and c.ulysses <= max_ulysses
        assert c.first % c.ulysses == 0 and c.first + c.ulysses <= ranks, "an aligned block"
        assert c.tokens == sum(lengths[i] for i in c.docs)
        assert c.per_rank * c.ulysses >= c.tokens and c.pad >= 0
        assert c.per_rank <= cap, "no rank holds more than the fixed degree's load"
        assert all(schedule.degrees[i] == c.ulysses for i in c.docs), "a document at its own degree"
        b = bucket if c.ulysses > 1 else whole_bucket  # whole documents exchange nothing: few shapes needless
        assert c.per_rank - math.ceil(c.tokens / c.ulysses) < b
        assert c.per_rank % b == 0 or c.per_rank == cap
    for r in range(ranks):
        mine = schedule.cells_of(r)
        assert all(r in c.ranks for c in mine)
        orders = [c.order for c in mine if c.ulysses > 1]
        assert orders == sorted(orders), "group cells in the one global order"
        assert all(c.ulysses == 1 for c in mine[len(orders) :]), "group cells first, then whole documents"
    for c in cells:  # a group cell is run by exactly its members
        assert sum(c in schedule.cells_of(r) for r in range(ranks)) == c.ulysses
    for c in cells:  # each document at the smallest degree that fits it, or at a cell's with room for it
        least = [degree_for(lengths[i], cap, max_ulysses) for i in c.docs]
        assert max(least) == c.ulysses, "a cell's degree is its largest document's"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 1024), min_size=1, max_size=80),
    st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 4), (8, 4), (8, 8)]),
    st.sampled_from([1, 16, 64]),
)
def test_every_schedule_keeps_every_rule(lengths, layout, bucket):
    ranks, max_ulysses = layout
    cap = 1024 // max_ulysses
    s = place(lengths, ranks=ranks, max_ulysses=max_ulysses, cap=cap, costs=COSTS, bucket=bucket)
    check(s, lengths, ranks=ranks, max_ulysses=max_ulysses, cap=cap, bucket=bucket)
    if sum(lengths) >= ranks * cap:  # a global batch of the trainer's size: every rank has work
        assert all(s.cells_of(r) for r in range(ranks))
    assert s == place(lengths, ranks=ranks, max_ulysses=max_ulysses, cap=cap, costs=COSTS, bucket=bucket)


def test_each_rank_runs_the_micro_batches_its_documents_need():
    """No rank splits micro-batches to match its peers (Megatron's schedule takes a count per rank):
    a rank's whole documents fill its micro-batches first fit, so no two of them would fit in one."""
    lengths = long_tailed_lengths(300, seed=3, median=60, longest=1024)
    s = place(lengths, ranks=4, max_ulysses=4, cap=256, costs=COSTS, bucket=16)
    check(s, lengths, ranks=4, max_ulysses=4, cap=256, bucket=16)
    for r in range(4):
        whole = [c.tokens for c in s.cells_of(r) if c.ulysses == 1]
        assert all(a + b > 256 for i, a in enumerate(whole) for b in whole[i + 1 :]), (r, whole)
    assert {1, 2, 4} <= set(s.degrees)


def test_a_micro_batchs_own_time_decides_between_opening_one_and_waiting():
    """Two ranks, load 100, 333 tokens of whole documents: with free micro-batches the placement
    balances the tokens over 5; when a micro-batch's own time outweighs the imbalance it packs them
    into 4, the fewest that hold them.  Every rank runs at least one either way."""
    docs = [63, 96, 47, 54, 26, 47]
    counts = {}
    for cell in (0.0, 200.0):
        s = place(docs, ranks=2, max_ulysses=2, cap=100, costs=Costs(token=1.0, cell=cell))
        check(s, docs, ranks=2, max_ulysses=2, cap=100)
        counts[cell] = [len(s.cells_of(r)) for r in range(2)]
    assert sum(counts[0.0]) == 5 and sum(counts[200.0]) == 4 and min(counts[200.0]) >= 1, counts


@pytest.mark.parametrize("mix", [dict(sigma=1.0, whole_every=100), dict(sigma=1.2, whole_every=25)])
def test_the_benchmarks_mixes_run_at_most_two_micro_batches_more_than_fixed_with_little_pad(mix):
    """tools/bench_dynamic.py's light and heavy mixes at world 4 (8 samples of 4096 a step: the fixed
    degree runs 8 micro-batches a rank), the trainer's CPU calibration and default bucket (1/64 of
    the load): at most 10 a rank (9 in most steps: the calibrated micro-batch costs as much as ~1000
    tokens, so the placement opens few), pad under 1% of the tokens."""
    from ulysses_mcore.megatron.trainer.dynamic import CPU_RATES
    from ulysses_mcore.planning.shape import ModelShape

    costs = Costs.from_rates(CPU_RATES, ModelShape(2, 128, 8, 4, vocab_size=384))
    lengths = long_tailed_lengths(1500, seed=1, longest=4096, median=200, **mix)
    samples = samples_of(lengths, 4096, 8 * 20)
    most = []
    for k in range(20):
        docs = [n for s in samples[8 * k : 8 * k + 8] for n in s]
        s = place(docs, ranks=4, max_ulysses=4, cap=1024, costs=costs, bucket=16)
        check(s, docs, ranks=4, max_ulysses=4, cap=1024, bucket=16)
        most.append(max(len(s.cells_of(r)) for r in range(4)))
        assert sum(c.pad for c in s.cells()) < 0.01 * sum(docs), k
    assert max(most) <= 10 and most.count(9) > most.count(10), most


def test_balanced_by_the_cost_model_and_exchanges_only_long_documents():
    lengths = long_tailed_lengths(400, seed=1, median=100, longest=2048, whole_every=100)
    cap = 512
    s = place(lengths, ranks=8, max_ulysses=4, cap=cap, costs=COSTS, bucket=32)
    assert max(s.finish) / (sum(s.work) / len(s.work)) < 1.05
    long_tokens = sum(L for L in lengths if L > cap)
    assert s.exchanged_tokens() - long_tokens < 0.1 * long_tokens  # only what must, plus pad
    assert s.exchanged_tokens() < 0.5 * sum(lengths)


def test_a_document_longer_than_the_largest_degree_holds_is_refused_with_the_fix():
    with pytest.raises(PlacementError) as e:
        degree_for(5000, cap=1024, max_ulysses=4)
    msg = str(e.value)
    assert "5000 tokens" in msg and "per-rank load 1024" in msg and "--ulysses-degree 8" in msg
    assert "--micro-batch-size" in msg
    with pytest.raises(PlacementError):
        place([10, 5000], ranks=4, max_ulysses=4, cap=1024)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(ranks=4, max_ulysses=3, cap=8), "power of two"),
        (dict(ranks=6, max_ulysses=4, cap=8), "not a multiple of --ulysses-degree 4"),
        (dict(ranks=4, max_ulysses=4, cap=0), "must be positive"),
    ],
)
def test_bad_layouts_are_named(kw, needle):
    with pytest.raises(ValueError, match=needle):
        place([1, 2, 3], **kw)


def test_cost_model_prefers_splitting_quadratic_work():
    c = Costs(token=1.0, pair=0.1, exchanged=0.0)
    assert c.document(1000, 2) == pytest.approx(c.document(1000, 1) / 2)
    assert Costs(token=1.0, exchanged=1.0).document(100, 4) > Costs(token=1.0).document(100, 4)


def test_samples_are_cut_like_megatrons_dataset_and_predictions_cover_three_modes():
    samples = samples_of([10, 30, 5], seq=16, count=4)
    assert all(sum(s) == 16 for s in samples)
    assert samples[0] == [11, 5]  # 10 + its end-of-document token, then the next document's first 5
    t = step_times(samples_of(long_tailed_lengths(100, longest=256), 256, 8), ranks=4, max_ulysses=4, costs=COSTS)
    assert set(t) == {"fixed", "degree 1", "dynamic"} and all(v > 0 for v in t.values())


def test_costs_from_the_step_time_models_rates():
    """The placement's costs come from the step-time model's rates (a calibration or a GPU preset),
    phase by phase; the trainer's CPU default is the committed world-4 CPU calibration."""
    import json
    import os

    from ulysses_mcore.megatron.trainer.dynamic import CPU_RATES
    from ulysses_mcore.planning.shape import MODELS
    from ulysses_mcore.planning.step_time import PRESETS, gpu_rates

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "perf", "calibration_w4", "calibration.json")) as f:
        fitted = json.load(f)["rates"]
    nonzero = {(p, t): v for p, terms in fitted.items() for t, v in terms.items() if v}
    assert {(p, t): v for p, terms in CPU_RATES.items() for t, v in terms.items()} == pytest.approx(nonzero, rel=5e-3)
    tiny = MODELS["tiny"]
    c = Costs.from_rates(fitted, tiny)
    assert c.token > 0 and c.pair > 0 and c.exchanged > 0 and c.cell > 0 and c.messages > 0
    assert c.pair == pytest.approx(fitted["attention"]["attn_flops"] * 12 * tiny.hidden_size * tiny.num_layers)
    calls = sum(fitted[p]["layer_calls"] for p in ("attention", "mlp", "rest"))
    assert c.cell == pytest.approx(calls * tiny.num_layers + fitted["rest"]["micro_batches"])
    gpu = Costs.from_rates(gpu_rates(PRESETS["h200"]), MODELS["llama8b"], dtype_bytes=2)
    assert gpu.document(131072, 8) < gpu.document(131072, 1)  # a long document is worth splitting on H200s
    inter = Costs.from_rates(gpu_rates(PRESETS["h200"]), MODELS["llama8b"], dtype_bytes=2, gpus_per_node=8)
    assert inter.document(131072, 8) == gpu.document(131072, 8)  # a cell inside a node: NVLink
    assert inter.document(262144, 16) > gpu.document(262144, 16)  # across two nodes: InfiniBand
