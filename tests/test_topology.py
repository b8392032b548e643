"""Tier 1: topology rank math, against Megatron-Core's RankGenerator."""

import random
import time

import pytest

from ulysses_mcore.topology import Topology, TopologyError


def random_configs(n, seed=0):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tp, u, cp, pp, dp = (rng.choice([1, 1, 2, 3, 4, 8]) for _ in range(5))
        ep = rng.choice([1, 2, 4])
        world = tp * u * cp * pp * dp
        if world > 4096 or world % (tp * ep * pp):
            continue
        order = rng.choice(["tp-ulysses-cp-ep-dp-pp", "tp-ulysses-cp-ep-pp-dp", "tp-pp-ulysses-cp-ep-dp"])
        if not order.endswith("pp") and pp > 1 and world // (tp * ep * pp) != dp:
            continue
        out.append(dict(world_size=world, tp=tp, ulysses=u, cp=cp, pp=pp, ep=ep, order=order))
    return out


CONFIGS = random_configs(300)


def test_groups_equal_megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    checked = 0
    for c in CONFIGS:
        t = Topology(**c)
        m_order = t.megatron_order()
        dec = RankGenerator(tp=t.tp, ep=1, dp=t.dp, pp=t.pp, cp=t.ulysses * t.cp, order=m_order)
        exp = RankGenerator(tp=t.tp, ep=t.ep, dp=t.edp, pp=t.pp, cp=1, order=m_order)
        for ours, theirs in [
            ("tp", "tp"),
            ("pp", "pp"),
            ("dp", "dp"),
            ("ulysses-cp", "cp"),
            ("dp-ulysses-cp", "dp-cp"),
            ("tp-ulysses-cp", "tp-cp"),
            ("tp-pp", "tp-pp"),
            ("tp-dp-ulysses-cp", "tp-dp-cp"),
        ]:
            assert t.groups(ours) == dec.get_ranks(theirs), (c, ours)
        for ours in ("ep", "tp-ep", "tp-ep-pp", "edp"):
            theirs = ours.replace("edp", "dp")
            assert t.groups(ours) == exp.get_ranks(theirs), (c, ours)
        # Ulysses = the first hierarchical-CP level: contiguous runs of each CP group
        want = sorted(tuple(g[i : i + t.ulysses]) for g in dec.get_ranks("cp") for i in range(0, len(g), t.ulysses))
        assert sorted(map(tuple, t.groups("ulysses"))) == want, c
        ring = sorted(tuple(g[i :: t.ulysses]) for g in dec.get_ranks("cp") for i in range(t.ulysses))
        assert sorted(map(tuple, t.groups("cp"))) == ring, c
        checked += 1
    assert checked == len(CONFIGS) == 300


def test_coords_rank_and_group_of_agree():
    for c in CONFIGS[:60]:
        t = Topology(**c)
        for r in random.Random(1).sample(range(t.world_size), min(20, t.world_size)):
            co = t.coords(r)
            assert t.rank(**{k: v for k, v in co.items() if k not in ("ep", "edp")}) == r
            for axes in ("tp", "ulysses", "cp", "dp", "pp", "ulysses-cp", "dp-ulysses-cp", "ep", "edp"):
                g = t.group_of(axes, r)
                assert r in g and g in t.groups(axes)


def test_every_group_partitions_the_world():
    t = Topology(96, tp=2, ulysses=4, cp=3, pp=2)
    for axes in ("tp", "ulysses", "cp", "dp", "pp", "ulysses-cp", "tp-ulysses"):
        flat = sorted(r for g in t.groups(axes) for r in g)
        assert flat == list(range(96))


def test_large_world_is_fast():
    t0 = time.perf_counter()
    t = Topology(131072, tp=8, ulysses=8, cp=2, pp=8)
    for axes in ("tp", "ulysses", "cp", "dp", "pp", "dp-ulysses-cp"):
        a = t.group_array(axes)
        assert a.size == 131072
    assert time.perf_counter() - t0 < 30  # generous: a hang guard, not a timing claim


@pytest.mark.parametrize(
    "kwargs,needles",
    [
        (dict(world_size=12, tp=2, ulysses=4, pp=2), ["tp(2) * ulysses(4) * cp(1) * pp(2) = 16", "WORLD_SIZE(12)"]),
        (dict(world_size=8, tp=0), ["--tensor-model-parallel-size", ">= 1"]),
        (dict(world_size=8, ulysses=-2), ["--ulysses-degree"]),
        (dict(world_size=8, ulysses=2, order="tp-ulysses-cp-dp-xx"), ["unknown axis", "xx"]),
        (dict(world_size=8, ulysses=2, order="tp-cp-dp-pp"), ["lacks axis 'ulysses'", "--ulysses-degree is 2"]),
        (dict(world_size=8, order="tp-cp-ulysses-dp-pp"), ["'cp' must come right after 'ulysses'"]),
        (dict(world_size=8, order="tp-tp-dp"), ["more than once"]),
        (dict(world_size=12, tp=2, ep=4), ["tp(2) * ep(4) * pp(1) = 8", "--expert-model-parallel-size"]),
    ],
)
def test_bad_topologies(kwargs, needles):
    with pytest.raises(TopologyError) as e:
        Topology(**kwargs)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


@pytest.mark.parametrize(
    "topo,model,needles",
    [
        (
            dict(world_size=8, tp=2, ulysses=4),
            dict(num_attention_heads=6),
            ["--ulysses-degree 4", "larger than the 3 query heads"],
        ),
        (
            dict(world_size=8, tp=2, ulysses=2),
            dict(num_attention_heads=20, num_query_groups=6),
            ["query heads (10) must be a multiple of kv heads (3)"],
        ),
        (dict(world_size=8, tp=4), dict(num_attention_heads=6), ["--tensor-model-parallel-size 4"]),
        (dict(world_size=8, ulysses=2, cp=2), dict(num_attention_heads=8, seq_length=100), ["--seq-length 100", "= 8"]),
        (
            dict(world_size=8, ulysses=4),
            dict(num_attention_heads=8, seq_length=6, load_balanced=False),
            ["--seq-length 6", "= 4"],
        ),
    ],
)
def test_model_checks(topo, model, needles):
    with pytest.raises(TopologyError) as e:
        Topology(**topo).check_model(**model)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_model_check_accepts_gqa_replication_and_uneven_heads():
    Topology(8, ulysses=8).check_model(num_attention_heads=32, num_query_groups=2, seq_length=8 * 2 * 64)
    Topology(8, tp=2, ulysses=4).check_model(num_attention_heads=12)  # 6 heads per tp rank over 4: 2, 2, 1, 1
    Topology(8, tp=2, ulysses=2).check_model(num_attention_heads=24, num_query_groups=6)  # 12 q / 3 kv


@pytest.mark.parametrize("kw", [dict(world_size=64, tp=2, ulysses=4, pp=2), dict(world_size=16, tp=2, ulysses=2, ep=2)])
def test_rank_inverts_coords(kw):
    """``rank(**coords(r)) == r`` for every rank, the expert grid's ep / edp included; a disagreeing
    expert coordinate is refused."""
    topo = Topology(kw.pop("world_size"), **kw)
    assert [topo.rank(**topo.coords(r)) for r in range(topo.world_size)] == list(range(topo.world_size))
    if topo.ep > 1:
        c = topo.coords(0)
        with pytest.raises(TopologyError, match="disagree"):
            topo.rank(**dict(c, ep=1 - c["ep"]))


def test_a_layout_by_name_round_trips_and_names_its_flags():
    lay = Topology.of(tp=2, ulysses=4, cp=1, pp=2, dp=3)
    assert (lay.world_size, lay.dp, lay.name) == (48, 3, "tp2-u4-cp1-pp2-dp3")
    assert Topology.parse(lay.name) == lay and Topology.parse("tp1-u2-cp1-pp1-dp2-ep2").ep == 2
    assert lay.flags() == [
        "--tensor-model-parallel-size",
        "2",
        "--ulysses-degree",
        "4",
        "--context-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
    ]
    for bad in ("tp2xu4", "tp1-u2-cp1-pp1", "tp1-u2-cp1-pp1-dp1-zz3"):
        with pytest.raises(ValueError, match="tpT-uU-cpC-ppP-dpD"):
            Topology.parse(bad)


@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
def test_crosses_nodes_agrees_with_the_ranks_node_by_node(gpus_per_node):
    """Independently: a group crosses nodes iff two of its ranks differ in rank // gpus_per_node."""
    for lay in (Topology.of(2, 2, 2, 1, 2), Topology.of(1, 4, 1, 2, 1), Topology.of(4, 1, 1, 1, 4)):
        for axes in ("tp", "ulysses", "cp", "dp", "pp", "ulysses-cp-dp"):
            want = any(len({r // gpus_per_node for r in g}) > 1 for g in lay.groups(axes))
            assert lay.crosses_nodes(axes, gpus_per_node) == want, (lay.name, axes)
    assert not Topology.of(1, 8).crosses_nodes("ulysses", None)
