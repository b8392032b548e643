"""ulysses_mcore.planning.longest: every layout of a cluster, each one's longest sequence by the memory
model under the preset's memory less the allocator's share, the longest first, and the dry run's command.
(The dry run of that command: tests/test_dryrun.py.)"""

import pytest

from ulysses_mcore.planning.longest import MEMORY_FLAGS, Cluster, dryrun_command, layouts, longest
from ulysses_mcore.planning.memory_model import estimate
from ulysses_mcore.planning.shape import MODELS


def test_layouts_keep_tensor_and_ulysses_groups_in_a_node_and_split_evenly():
    shape, cluster = MODELS["llama8b"], Cluster(32, "h100")
    lays = layouts(shape, cluster)
    assert lays and len({lay.name for lay in lays}) == len(lays)
    for lay in lays:
        assert lay.world_size == 32 and lay.tp * lay.ulysses <= 8
        assert shape.num_query_groups % lay.tp == 0 and (shape.num_attention_heads // lay.tp) % lay.ulysses == 0
        assert shape.num_layers % lay.pp == 0
        assert lay.cp == 1 or lay.tp * lay.ulysses == 8  # a ring only across nodes
    assert {"tp1-u8-cp1-pp1-dp4", "tp2-u4-cp4-pp1-dp1", "tp1-u8-cp4-pp1-dp1"} <= {lay.name for lay in lays}


@pytest.mark.parametrize("world", [1, 8, 32])
def test_each_plan_is_the_longest_that_fits_its_layout(world):
    """The winner's estimate fits the budget and one step more does not; no other layout is longer."""
    shape, cluster = MODELS["llama8b"], Cluster(world, "h100")
    plans = longest(shape, cluster)
    best = plans[0]
    assert best.seq_length > 0 and all(p.seq_length <= best.seq_length for p in plans)
    assert best.estimate["total_bytes"] <= cluster.budget_bytes
    lay, step = best.layout, 2 * best.layout.ulysses * best.layout.cp * best.layout.tp
    kw = dict(shape.keywords(), micro_batch_size=1, tp=lay.tp, ulysses=lay.ulysses, cp=lay.cp, pp=lay.pp, dp=lay.dp)
    kw.update(bf16=True, recompute="full", distributed_optimizer=True, loss_chunk_tokens=4096)
    kw.update(mlp_chunk_tokens=4096, offload=True, optimizer_offload=True, tied_embeddings=False)
    assert estimate(seq_length=best.seq_length, **kw)["total_bytes"] == best.estimate["total_bytes"]
    assert estimate(seq_length=best.seq_length + step, **kw)["total_bytes"] > cluster.budget_bytes
    assert best.host_gb_per_node == pytest.approx(best.estimate["host_bytes"] * min(world, 8) / 1e9)


def test_more_gpus_train_longer_sequences():
    shape = MODELS["llama8b"]
    lengths = [longest(shape, Cluster(w, "h100"))[0].seq_length for w in (1, 8, 32)]
    assert lengths[0] < lengths[1] < lengths[2]
    assert longest(shape, Cluster(8, "h200"))[0].seq_length > lengths[1]  # 141 GB against 80


def test_offload_moves_the_layer_inputs_and_the_optimizer_to_the_host():
    kw = dict(MODELS["llama8b"].keywords(), seq_length=65536, bf16=True, recompute="full")
    kw.update(distributed_optimizer=True)
    on = estimate(offload=True, optimizer_offload=True, **kw)
    off = estimate(**kw)
    layer_input = 65536 * 4096 * 2
    logits = 65536 * 128256 * 4  # the loss's fp32 logits (no chunked loss here)
    adam_on_host = 16 * on["params_per_rank"]  # fp32 weights, gradients and two moments (dry run: measured)
    assert on["host_bytes"] == pytest.approx((32 + 2) * layer_input + logits + adam_on_host)
    # on the device: the input in use (the layer below's comes back after the attention's backward),
    # and the recomputed layer's output is not held through its backward (offload.ShapeOnly)
    assert off["activations_bytes"] - on["activations_bytes"] == pytest.approx((31 + 1) * layer_input)
    assert on["optimizer_bytes"] == 0 and off["host_bytes"] == 0


def test_the_dry_run_command_carries_model_layout_memory_and_cluster():
    shape, cluster = MODELS["llama8b"], Cluster(8, "h200")
    best = longest(shape, cluster)[0]
    cmd = dryrun_command(["--num-layers", "32"], best, cluster).split()
    assert cmd[:4] == ["ulysses-mcore", "dryrun", "--num-layers", "32"]
    for flag in MEMORY_FLAGS:
        assert flag in cmd
    text = " ".join(cmd)
    assert f"--ulysses-degree {best.layout.ulysses}" in text and f"--seq-length {best.seq_length}" in text
    assert text.endswith("--world-size 8 --preset h200")
