"""Real groups in a gloo world of 4 processes, membership proven by collectives (tier 3); the
(Ulysses, ring) pair found in a Megatron collection, in a threaded world (tier 2)."""

import pytest
import torch.distributed as dist

from tests.helpers import run_spawned, run_threaded

CONFIGS = [
    dict(ulysses=2, pp=2),
    dict(tp=2, ulysses=2),
    dict(ulysses=4),
    dict(ulysses=2, cp=2),  # hierarchical CP
    dict(ulysses=2),  # dp 2
]


def _world(rank, world):
    import torch
    import torch.distributed as dist

    import ulysses_mcore
    from ulysses_mcore.megatron.layer import groups

    results = []
    for cfg in CONFIGS:
        topo = ulysses_mcore.initialize(**cfg, verbose=False)
        got = {}
        named = {
            "ulysses": groups.get_ulysses_group(),
            "cp": groups.get_ring_group(),
            "tp": groups.get_tensor_parallel_group(),
            "pp": groups.get_pipeline_parallel_group(),
            "dp": groups.get_data_parallel_group(),
            "dp-ulysses-cp": groups.get_gradient_reduction_group(),
            "ulysses-cp": groups.get_sample_group(),
        }
        for axes, grp in named.items():
            if grp is None:
                got[axes] = None
                continue
            t = torch.tensor([rank], dtype=torch.int64)
            dist.all_reduce(t, group=grp)
            got[axes] = (t.item(), sum(topo.group_of(axes, rank)))
        # a layer finds the same groups in Megatron's own collection, split as the config says
        levels = [topo.ulysses, topo.cp] if topo.cp > 1 else None
        ranks = [None if g is None else dist.get_process_group_ranks(g) for g in (named["ulysses"], named["cp"])]
        found = groups.sequence_groups(levels, groups.get_pg_collection())
        got["layer's groups"] = ranks == [None if g is None else dist.get_process_group_ranks(g) for g in found]
        results.append(got)
        groups.destroy()

    # megatron_patches: Megatron-LM's own initialize_model_parallel call records the layout
    import argparse

    import megatron_patches
    from megatron.core import parallel_state as ps

    megatron_patches.fold_args(argparse.Namespace(ulysses_degree=4, context_parallel_size=1))
    megatron_patches.apply()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=4)
        g = groups.get_ulysses_group()
        results.append(
            {
                "patched": sorted(dist.get_process_group_ranks(g))
                == sorted(dist.get_process_group_ranks(ps.get_context_parallel_group()))
                and dist.get_world_size(g) == 4
            }
        )
    finally:
        megatron_patches.remove()
        groups.destroy()
    return results


@pytest.mark.spawn
def test_real_groups_match_pure_math():
    per_rank = run_spawned(4, _world)
    for rank, results in enumerate(per_rank):
        assert results[-1] == {"patched": True}, rank
        for cfg, got in zip(CONFIGS, results[:-1]):
            for axes, val in got.items():
                if axes == "layer's groups":
                    assert val, (rank, cfg)
                    continue
                if val is None:  # only absent when that degree is 1
                    assert cfg.get(axes, 1) == 1, (rank, cfg, axes)
                    continue
                reduced, predicted = val
                assert reduced == predicted, (rank, cfg, axes, reduced, predicted)


def test_groups_come_from_megatrons_collection_as_its_config_splits_it():
    """Megatron's pg_collection: its context-parallel group is all Ulysses without levels in the
    config; with ``hierarchical_context_parallel_sizes = [U, C]`` the collection's two levels (a
    level of one rank is no group); levels the collection lacks are refused by name (no guess)."""
    from types import SimpleNamespace

    from ulysses_mcore import new_sequence_groups
    from ulysses_mcore.megatron.layer.groups import sequence_groups

    def rank_fn(rank, world):
        ug, rg = new_sequence_groups(2, 2)
        pg = SimpleNamespace(cp=dist.group.WORLD, hcp=[ug, rg])
        assert sequence_groups(None, pg) == (dist.group.WORLD, None)
        assert sequence_groups([2, 2], pg) == (ug, rg)
        with pytest.raises(ValueError, match=r"hierarchical_context_parallel_sizes=\[2, 2\].*no levels"):
            sequence_groups([2, 2], SimpleNamespace(cp=dist.group.WORLD))
        return True

    assert all(run_threaded(4, rank_fn))
