"""Real process groups: a :class:`~ulysses_mcore.topology.Topology` made into
torch.distributed groups, with Megatron-Core's ``parallel_state`` initialised to match.

Ulysses x ring cp is handed to Megatron as its context-parallel axis
(``context_parallel_size = ulysses * cp``, ``hierarchical_context_parallel_sizes =
[ulysses, cp]`` when both are > 1).  Megatron therefore sees the right world everywhere it
already handles CP: gradients of weights (replicated across Ulysses ranks) are reduced
over ``dp x ulysses x cp`` by its DDP, the distributed optimizer shards over the same
group, loss and token counts reduce over it, and ``tp-dp-cp`` etc. exist.  The Ulysses
group is Megatron's first hierarchical-CP level (or the whole CP group when ``cp == 1``).
"""

from __future__ import annotations

import gc
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from ulysses_mcore.topology import Topology

_BUILT: dict = {}  # the Topology initialize() (or the Megatron-LM patches) built, for get_topology()


def initialize(
    tp: int = 1,
    ulysses: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    *,
    order: str = "tp-ulysses-cp-ep-dp-pp",
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    distributed_timeout_minutes: int = 30,
    num_attention_heads: Optional[int] = None,
    num_query_groups: Optional[int] = None,
    seq_length: Optional[int] = None,
    verbose: bool = True,
    gloo_groups: bool = True,
) -> Topology:
    """Build every group for this topology and initialise Megatron-Core's parallel_state.

    Needs ``torch.distributed`` initialised (gloo on CPU, NCCL on GPU, or torch's fake backend with
    ``gloo_groups=False``: the dry run).  Model-aware
    checks run first when heads / sequence length are given, on every rank before any
    collective, so a bad configuration raises the same error everywhere.
    """
    if not dist.is_initialized():
        raise RuntimeError("ulysses_mcore.initialize needs torch.distributed.init_process_group() first")
    topo = Topology(dist.get_world_size(), tp=tp, ulysses=ulysses, cp=cp, pp=pp, ep=ep, order=order)
    if num_attention_heads is not None:
        topo.check_model(num_attention_heads, num_query_groups, seq_length)

    if ps.model_parallel_is_initialized():
        destroy()
    before = set(_live_groups())
    # a ring gets Megatron's two hierarchical levels (Ulysses inner, [1, cp] for a ring alone), so the
    # layers find both groups in Megatron's own pg_collection (sequence_groups)
    hier = [ulysses, cp] if cp > 1 else None
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=topo.context_parallel_size,
        hierarchical_context_parallel_sizes=hier,
        expert_model_parallel_size=ep,
        order=topo.megatron_order(),
        distributed_timeout_minutes=distributed_timeout_minutes,
        create_gloo_process_groups=gloo_groups,  # the optimizer asks for them; a fake world has no gloo
    )
    ulysses_group, ring = sequence_groups(hier, mpu_collection())

    rank = dist.get_rank()
    _verify(topo, rank, ulysses_group, ring)

    remember(topo)
    _CREATED[:] = [g for g in _live_groups() if g not in before]
    if verbose and rank == 0:
        print(
            f"[ulysses-mcore] parallel axes in force: {topo.describe()}; "
            f"Megatron context-parallel size {topo.context_parallel_size} "
            f"(ulysses {ulysses} inner x ring {cp})",
            flush=True,
        )
    return topo


def group_size(group) -> int:
    """A group's size (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def _or_none(group):
    """A group of one rank is no group (degree 1)."""
    return None if group_size(group) == 1 else group


def mpu_collection():
    """Megatron's collection of parallel_state's groups (for a module built without one), or
    ``None`` before parallel_state is initialised."""
    if not ps.model_parallel_is_initialized():
        return None
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "hcp"])


def sequence_groups(levels, pg_collection):
    """``(ulysses_group, ring_group)`` in Megatron's context-parallel axis as ``levels`` (a config's
    ``hierarchical_context_parallel_sizes``) splits it: ``[ulysses, ring]`` -> the collection's two
    hierarchical levels (``pg_collection.hcp``, Ulysses inner); without two levels the whole
    context-parallel group is Ulysses.  ``None`` for a level of one rank.  The one place the pair is
    derived: the layers (from the collection Megatron hands them), :func:`initialize` and the
    getters (from parallel_state's)."""
    if pg_collection is None:
        return None, None
    levels = list(levels or [])
    if len(levels) != 2:
        return _or_none(pg_collection.cp), None
    hcp = list(getattr(pg_collection, "hcp", None) or [])[:2]
    sizes = [group_size(g) for g in hcp]
    if sizes != levels:
        raise ValueError(
            f"config.hierarchical_context_parallel_sizes={levels} (ulysses, ring) but Megatron's "
            f"pg_collection.hcp has {'levels of ' + str(sizes) if sizes else 'no levels'}: initialise "
            f"parallel_state with hierarchical_context_parallel_sizes={levels} (ulysses_mcore.initialize does)"
        )
    return _or_none(hcp[0]), _or_none(hcp[1])


def remember(topology) -> None:
    """Record the layout this process's groups were built for (read back by :func:`get_topology`)."""
    _BUILT["topology"] = topology


def _verify(topo: Topology, rank: int, ulysses_group, ring) -> None:
    """Megatron's groups for this rank must be the ones the pure math predicts."""
    checks = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "ulysses-cp": ps.get_context_parallel_group(),
        "dp-ulysses-cp": ps.get_data_parallel_group(with_context_parallel=True),
    }
    if ulysses_group is not None:
        checks["ulysses"] = ulysses_group
    if ring is not None:
        checks["cp"] = ring
    if ulysses_group is not None and ring is not None:
        # Megatron's CP rank must be ulysses rank + ulysses * ring rank (Ulysses inner): that is
        # the shard order the dual-chunk batch slicing, RoPE slicing and the hybrid path share
        want = dist.get_rank(ulysses_group) + topo.ulysses * dist.get_rank(ring)
        if ps.get_context_parallel_rank() != want:
            raise RuntimeError(
                f"rank {rank}: Megatron's context-parallel rank {ps.get_context_parallel_rank()} is not "
                f"ulysses rank + {topo.ulysses} x ring rank = {want}"
            )
    for axes, grp in checks.items():
        got = dist.get_process_group_ranks(grp)
        want = topo.group_of(axes, rank)
        if sorted(got) != sorted(want):
            raise RuntimeError(
                f"rank {rank}: Megatron's {axes} group {got} differs from the topology's {want} ({topo.describe()})"
            )


def get_topology() -> Topology:
    topo = built_topology()
    if topo is None:
        raise RuntimeError(
            "no topology built: call ulysses_mcore.initialize(...) first (or run under "
            "megatron_patches, which records Megatron-LM's)"
        )
    return topo


def get_ulysses_group():
    """The Ulysses all-to-all group of this rank (``None`` when the degree is 1)."""
    return _sequence_groups()[0]


def get_ring_group():
    """The ring context-parallel group of this rank (``None`` when cp == 1)."""
    return _sequence_groups()[1]


def built_topology():
    """The Topology :func:`initialize` (or the Megatron-LM patches) built, or ``None``."""
    return _BUILT.get("topology")


def _sequence_groups():
    topo = built_topology()
    if topo is None:
        return None, None
    return sequence_groups([topo.ulysses, topo.cp] if topo.cp > 1 else None, mpu_collection())


def get_tensor_parallel_group():

    return ps.get_tensor_model_parallel_group()


def get_pipeline_parallel_group():

    return ps.get_pipeline_model_parallel_group()


def get_data_parallel_group():
    """Pure data parallel: ranks holding different samples, same tokens positions."""
    return ps.get_data_parallel_group()


def get_gradient_reduction_group():
    """dp x ulysses x cp: weights are replicated over it, so gradients are reduced over it."""
    return ps.get_data_parallel_group(with_context_parallel=True)


def get_sample_group():
    """ulysses x cp: the ranks that read the same sample (each a shard of its tokens)."""
    return ps.get_context_parallel_group()


def get_embedding_group():

    return ps.get_embedding_group()


def get_pg_collection():
    """Megatron's ``ProcessGroupCollection`` of the current groups (its context-parallel group is
    Ulysses x ring, its ``hcp`` the two levels when there is a ring)."""
    return ProcessGroupCollection.use_mpu_process_groups()


_CREATED: list = []  # the process groups initialize() made (destroy() destroys exactly these)


def _live_groups():
    return [g for g in dist.distributed_c10d._world.pg_map if g is not dist.GroupMember.WORLD]


def destroy() -> None:
    """Tear down Megatron's parallel_state, destroy the process groups :func:`initialize` made
    (Megatron only drops its references: re-initialising would pile up gloo groups and their
    threads, hundreds per rank) and forget the Ulysses groups."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    gc.collect()  # models and optimizers of the old layout sit in reference cycles that hold its groups
    live = set(_live_groups())
    for g in _CREATED:
        if g in live:
            dist.destroy_process_group(g)
    _CREATED.clear()
    _BUILT.clear()


def ulysses_rank() -> int:
    g = get_ulysses_group()
    return 0 if g is None else dist.get_rank(g)


def rank_groups() -> str:
    """This rank's groups, for debugging."""
    topo = get_topology()
    r = dist.get_rank()
    return "; ".join(f"{a}: {topo.group_of(a, r)}" for a in ("tp", "ulysses", "cp", "dp", "pp"))


__all__ = [
    "initialize",
    "destroy",
    "get_topology",
    "get_ulysses_group",
    "get_ring_group",
    "get_tensor_parallel_group",
    "get_pipeline_parallel_group",
    "get_data_parallel_group",
    "get_gradient_reduction_group",
    "get_sample_group",
    "get_embedding_group",
    "get_pg_collection",
    "ulysses_rank",
    "rank_groups",
]
