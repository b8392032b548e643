"""The longest sequence a cluster can train, the layout and memory flags that reach it, and the dry run
that checks it (``ulysses-mcore plan --longest``).

For a model shape and a cluster (``world`` GPUs of a preset: its memory and GPUs per node) every layout
``tp x ulysses x cp x pp x dp`` that Megatron and Ulysses accept is tried with every memory feature on --
bf16, the distributed optimizer with its state in host memory, full recompute with the layer inputs in
host memory, the chunked loss, the tiled MLP -- and the memory model
(:mod:`ulysses_mcore.planning.memory_model`) finds each one's longest sequence under the preset's memory
less ``headroom`` (the allocator's share).  The winner is the longest; among equals the one the
step-time model predicts fastest.  Tensor and Ulysses groups stay inside a node (their all-to-alls
and all-reduces run every layer), a ring only spans nodes.  Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from ..topology import Topology
from .memory_model import estimate, longest_sequence
from .shape import ModelShape
from .step_time import PRESETS, Run, gpu_rates, predict

CHUNK_TOKENS = 4096  # the chunked loss's and the tiled MLP's tokens per chunk
MEMORY_FLAGS = [
    "--bf16",
    "--use-distributed-optimizer",
    "--recompute-granularity",
    "full",
    "--offload-activation-checkpoints",
    "--loss-chunk-tokens",
    str(CHUNK_TOKENS),
    "--mlp-chunk-tokens",
    str(CHUNK_TOKENS),
    "--optimizer-cpu-offload",
]


@dataclass(frozen=True)
class Choices:
    """What the user fixes beside the model: ``tied`` (the output layer shares the input embedding,
    Megatron-LM's default), ``bf16_grads`` (``--grad-reduce-in-bf16``: DDP's gradients kept and
    summed in bf16 -- half the gradient buffer, sums rounded to bf16; Megatron-LM's opt-in), ``biases``
    (the linear layers' biases, Megatron's default; ``--disable-bias-linear``: none)."""

    tied: bool = False
    bf16_grads: bool = False
    biases: bool = True

    @property
    def flags(self) -> List[str]:
        """The memory flags a plan with these choices trains with."""
        return MEMORY_FLAGS + (["--grad-reduce-in-bf16"] if self.bf16_grads else [])


@dataclass(frozen=True)
class Cluster:
    """``world`` GPUs of ``preset`` (``h100``, ``h200``), ``headroom`` of each GPU's memory left free."""

    world: int
    preset: str = "h100"
    headroom: float = 0.08

    @property
    def memory_gb(self) -> float:
        return PRESETS[self.preset]["memory_gb"]

    @property
    def budget_bytes(self) -> float:
        return self.memory_gb * 1e9 * (1 - self.headroom)

    @property
    def gpus_per_node(self) -> int:
        return min(PRESETS[self.preset]["gpus_per_node"], self.world)


@dataclass
class Plan:
    """One layout's longest sequence: its memory by the model, its predicted speed."""

    layout: Topology
    seq_length: int
    gpus_per_node: int = 8
    estimate: Dict[str, float] = field(default_factory=dict)
    tokens_per_s_per_gpu: float = 0.0

    @property
    def host_gb_per_node(self) -> float:
        """Host memory of a node's ranks for the offloaded layer inputs."""
        return self.estimate.get("host_bytes", 0.0) * self.gpus_per_node / 1e9


def _powers(limit: int) -> List[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def layouts(shape: ModelShape, cluster: Cluster) -> List[Topology]:
    """Every layout of the cluster: tp and Ulysses groups inside a node, a ring only across nodes (tp x
    Ulysses filling each node), heads and query groups split evenly, layers split evenly over the
    stages, the rest data-parallel."""
    out = []
    n, node = cluster.world, cluster.gpus_per_node
    for tp in _powers(node):
        if shape.num_attention_heads % tp or shape.num_query_groups % tp:
            continue
        for u in _powers(node // tp):
            if (shape.num_attention_heads // tp) % u:
                continue
            for cp in _powers(n // (tp * u)) if tp * u == node else [1]:
                for pp in _powers(n // (tp * u * cp)):
                    if shape.num_layers % pp or n % (tp * u * cp * pp):
                        continue
                    out.append(Topology.of(tp, u, cp, pp, n // (tp * u * cp * pp)))
    return out


def _keywords(shape: ModelShape, lay: Topology, choices: Choices) -> dict:
    return dict(
        **shape.keywords(),
        tied_embeddings=choices.tied,
        grad_reduce_in_bf16=choices.bf16_grads,
        bias_linear=choices.biases,
        micro_batch_size=1,
        tp=lay.tp,
        ulysses=lay.ulysses,
        cp=lay.cp,
        pp=lay.pp,
        dp=lay.dp,
        bf16=True,
        recompute="full",
        distributed_optimizer=True,
        loss_chunk_tokens=CHUNK_TOKENS,
        mlp_chunk_tokens=CHUNK_TOKENS,
        offload=True,
        optimizer_offload=True,
    )


def plan_layout(shape: ModelShape, cluster: Cluster, lay: Topology, choices: Choices = Choices()) -> Plan:
    """The layout's longest sequence (a multiple of 2 x ulysses x cp x tp), its estimate and speed."""
    kw = _keywords(shape, lay, choices)
    seq = longest_sequence(cluster.budget_bytes, 2 * lay.ulysses * lay.cp * lay.tp, **kw)
    plan = Plan(lay, seq, cluster.gpus_per_node)
    if seq:
        plan.estimate = estimate(seq_length=seq, **kw)
        run = Run(shape, seq, 1, lay.dp, bf16=True, recompute="full", distributed_optimizer=True)
        step = predict(gpu_rates(PRESETS[cluster.preset]), run, lay, cluster.gpus_per_node)["step_s"]
        plan.tokens_per_s_per_gpu = lay.dp * seq / step / lay.world_size
    return plan


def longest(shape: ModelShape, cluster: Cluster, choices: Choices = Choices()) -> List[Plan]:
    """Every layout's plan, the longest sequence first (ties: the fastest first)."""
    plans = [plan_layout(shape, cluster, lay, choices) for lay in layouts(shape, cluster)]
    return sorted(plans, key=lambda p: (-p.seq_length, -p.tokens_per_s_per_gpu))


def dryrun_command(model_flags: List[str], plan: Plan, cluster: Cluster, choices: Choices = Choices()) -> str:
    """The ``ulysses-mcore dryrun`` command that checks ``plan`` on fake CUDA."""
    argv = ["ulysses-mcore", "dryrun", *model_flags, *plan.layout.flags(), *choices.flags]
    argv += ["--micro-batch-size", "1", "--global-batch-size", str(plan.layout.dp)]
    argv += ["--seq-length", str(plan.seq_length), "--max-position-embeddings", str(plan.seq_length)]
    argv += ["--world-size", str(cluster.world), "--preset", cluster.preset]
    return " ".join(argv)


__all__ = ["Choices", "Cluster", "Plan", "MEMORY_FLAGS", "layouts", "plan_layout", "longest", "dryrun_command"]
