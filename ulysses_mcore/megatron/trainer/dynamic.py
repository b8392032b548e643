"""``--dynamic-ulysses``: a Ulysses degree per document, executed with Megatron-Core's own parts.

The placement is pure arithmetic (:mod:`ulysses_mcore.planning.placement`); this module carries it
out:

* :class:`DynamicGroups` -- built once at start-up: a group for every aligned block of every
  power-of-two degree ``2 .. U`` over the ranks that share a tensor-parallel rank (Megatron sees
  them as its data-parallel axis: ``context_parallel_size = 1``, so its DDP reduces gradients and
  its loss reduces token counts over all of them, exactly as over ``dp x ulysses`` at a fixed degree);
* :class:`DynamicBatches` -- per global batch, every rank reads the same samples, splits them into
  documents at EOD, places them (:func:`~ulysses_mcore.planning.placement.place`) and builds its
  own cells' micro-batches: one packed stream per cell, this rank's contiguous share, the slot's
  group in Megatron's ``PackedSeqParams.cp_group`` (the field Megatron has for a per-micro-batch
  context-parallel group), which :class:`~ulysses_mcore.megatron.layer.module.UlyssesAttention` reads;
* RoPE after the all-to-all: :class:`~ulysses_mcore.megatron.layer.rotary.RotaryKernel`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams

from ulysses_mcore.validation.agreement import agree, digest
from ulysses_mcore.megatron.layer.batch import pack_batch
from ulysses_mcore.megatron.trainer.arguments import padded_vocab
from ulysses_mcore.planning.calibration import Calibration
from ulysses_mcore.planning.placement import Cell, Costs, Schedule, place, powers_of_two
from ulysses_mcore.planning.shape import ModelShape
from ulysses_mcore.planning.step_time import PRESETS, gpu_rates
from ulysses_mcore.topology import Topology


class DynamicGroups:
    """The groups of every power-of-two degree ``2 .. max_ulysses``: for each tensor-parallel rank,
    its line of ranks (the data-parallel group of the :class:`~ulysses_mcore.topology.Topology` with
    context parallelism 1: Megatron's), cut into aligned blocks.  Every rank creates every group in
    the same order (``new_group`` is collective)."""

    def __init__(self, world: int, tp: int, max_ulysses: int):
        line = Topology(world, tp=tp)
        lines = line.groups("dp")  # one per tensor-parallel rank
        me = dist.get_rank()
        self.ranks = line.dp  # ranks on one line
        self.max_ulysses = max_ulysses
        self.index = line.coords(me)["dp"]
        self._mine: Dict[tuple, object] = {}
        for d in powers_of_two(max_ulysses):
            for first in range(0, self.ranks, d):
                for members in (ranks[first : first + d] for ranks in lines):
                    g = dist.new_group(members)
                    if me in members:
                        self._mine[(first, d)] = g

    def group(self, cell: Cell):
        """This rank's group for ``cell`` (``None`` for a cell of one rank)."""
        return None if cell.ulysses == 1 else self._mine[(cell.first, cell.ulysses)]

    def mine(self) -> list:
        """The groups this rank is in."""
        return list(self._mine.values())

    def destroy(self) -> None:
        for g in self._mine.values():
            dist.destroy_process_group(g)
        self._mine.clear()


SEQ = ("tokens", "labels", "loss_mask", "position_ids")


class DynamicBatches:
    """A global batch's micro-batches for this rank under ``--dynamic-ulysses``, and what its
    schedule did (``last``: slots, documents per degree, exchanged tokens, the scheduler's time)."""

    def __init__(
        self, groups: DynamicGroups, *, cap: int, costs: Costs, bucket, eod: int, reset_positions: bool
    ):  # bucket: (a cell's of degree > 1, a micro-batch of whole documents'): bucket_of
        self.groups, self.cap, self.costs, (self.bucket, self.whole_bucket) = groups, cap, costs, bucket
        self.eod, self.reset_positions = eod, reset_positions
        self.last: Dict = {}

    def microbatches(self, samples: List[Dict[str, torch.Tensor]]) -> List[Dict]:
        """``samples``: the global batch as micro-batches ``[mbs, s]`` (every rank the same, in the
        fixed degree's order); returns this rank's cells as packed micro-batches, in slot order."""
        whole = {k: torch.cat([mb[k] for mb in samples]) for k in SEQ}
        stream = pack_batch(whole, self.eod, reset_positions=self.reset_positions)
        cu = stream["cu_seqlens"].tolist()
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        t0 = time.perf_counter()
        schedule = place(
            lengths,
            ranks=self.groups.ranks,
            max_ulysses=self.groups.max_ulysses,
            cap=self.cap,
            costs=self.costs,
            bucket=self.bucket,
            whole_bucket=self.whole_bucket,
        )
        self.last = placement_report(schedule, lengths, time.perf_counter() - t0)
        self._agree(lengths)
        idle = [r for r in range(self.groups.ranks) if not schedule.cells_of(r)]
        if idle:  # every rank computed the same schedule: the same error everywhere, before any cell runs
            raise ValueError(
                f"--dynamic-ulysses: the global batch has too few documents for {self.groups.ranks} ranks "
                f"({len(lengths)} documents; ranks {idle} would get none); raise --global-batch-size"
            )
        return [self._cell(stream, cu, lengths, c) for c in schedule.cells_of(self.groups.index)]

    def _agree(self, lengths) -> None:
        """One all-reduce a step over the ranks that share this placement: they must have read the same
        documents (else their cells' shapes differ and an all-to-all would abort the process)."""
        if not agree(digest(tuple(lengths)), ps.get_data_parallel_group()):
            raise ValueError(
                "--dynamic-ulysses: the ranks read different global batches (their documents' lengths differ), "
                "so their placements differ; every rank must read the same data (the same --data-path, --split "
                "and --seed on every rank)"
            )

    def _cell(self, stream, cu, lengths, cell: Cell) -> Dict:
        """This rank's contiguous share of ``cell``'s packed stream (its documents, then one pad document)."""
        pieces = [torch.arange(cu[i], cu[i + 1]) for i in cell.docs]
        index = torch.cat(pieces)
        full = {k: stream[k][0, index] for k in SEQ}
        if cell.pad:
            pad = {"tokens": self.eod, "labels": self.eod, "loss_mask": 0, "position_ids": 0}
            full = {k: torch.cat([v, v.new_full((cell.pad,), pad[k])]) for k, v in full.items()}
        j = self.groups.index - cell.first
        mine = {k: v[j * cell.per_rank : (j + 1) * cell.per_rank].unsqueeze(0) for k, v in full.items()}
        doc_lengths = [lengths[i] for i in cell.docs] + ([cell.pad] if cell.pad else [])
        bounds = torch.tensor([0] + list(_cumsum(doc_lengths)), dtype=torch.int32)
        longest = max(doc_lengths)
        mine["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            cp_group=self.groups.group(cell),
        )
        return mine


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def placement_report(schedule: Schedule, lengths: List[int], seconds: float) -> Dict:
    """What a schedule does: micro-batches a rank, documents per degree, pad, tokens through an all-to-all (pad
    included) against the fixed degree's (all of them), the cost model's busiest / mean rank."""
    per_degree: Dict[int, int] = {}
    for d in schedule.degrees:
        per_degree[d] = per_degree.get(d, 0) + 1
    finish = schedule.finish or [0.0]
    mean = sum(finish) / len(finish)  # each rank's end on the cost model's clock, micro-batches' own time included
    counts = [len(schedule.cells_of(r)) for r in range(schedule.ranks)]
    return {
        "slots": schedule.slots,
        "micro_batches": (min(counts), max(counts)),  # a rank's, fewest and most
        "pad_tokens": sum(c.pad for c in schedule.cells()),
        "documents": dict(sorted(per_degree.items())),
        "exchanged_tokens": schedule.exchanged_tokens(),
        "tokens": sum(lengths),
        "predicted_busy_max_over_mean": max(finish) / mean if mean else 1.0,
        "scheduler_seconds": seconds,
    }


# the step-time model's rates calibrated on this project's 2-core CPU at world 4, 512 and 1024 tokens
# (docs/perf/calibration_w4/calibration.json, its non-zero rates to 3 digits): s per FLOP, query row,
# message, byte, parameter, micro-batch and layer call of each phase
CPU_RATES = {
    "attention": {"attn_flops": 2.79e-11, "attn_rows": 1.15e-07, "layer_calls": 0.00524},
    "mlp": {"mlp_flops": 1.11e-11, "layer_calls": 0.00254, "tp_mlp_bytes_intra": 1.1e-08},
    "a2a": {"a2a_msgs": 0.00178, "a2a_bytes_intra": 2.35e-08},
    "ring": {"ring_msgs": 0.00188, "ring_bytes_intra": 1.67e-08},
    "optimizer": {"params": 6.84e-08},
    "rest": {
        "micro_batches": 0.00372,
        "layer_calls": 0.00448,
        "bubble_flops": 3.47e-11,
        "pp_bytes_intra": 4.2e-09,
        "tp_bytes_intra": 1.9e-08,
    },
}


def costs_of(args) -> Costs:
    """The placement's cost model for the run's model: the rates of ``--calibration FILE``
    (``ulysses-mcore fit``'s ``calibration.json``, checked with the flags), else the project's CPU
    calibration on a CPU and the H200 preset on a GPU (``ulysses-mcore predict``'s); cells wider than
    a node priced at the inter-node rate."""
    model = ModelShape.from_args(args, vocab_size=padded_vocab(args))
    if args.calibration:
        rates = Calibration.load(args.calibration).rates
    else:
        rates = gpu_rates(PRESETS["h200"]) if torch.cuda.is_available() else CPU_RATES
    # a cell of d line ranks spans d x tp ranks: across nodes where that exceeds a node (torchrun's count)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) // args.tensor_model_parallel_size or None
    return Costs.from_rates(rates, model, dtype_bytes=2 if args.bf16 else 4, gpus_per_node=per_node)


def bucket_of(args, cap: int):
    """(a cell's per-rank tokens are rounded to this: ``--dynamic-bucket``, else 1/64 of the load, at
    most 64 exchanged shapes a degree and under 1% pad on the benchmark's mixes; a micro-batch of
    whole documents, which exchanges nothing, is not rounded): with ``--sequence-parallel`` both
    multiples of the tensor-parallel size (Megatron splits each micro-batch's tokens over it)."""
    bucket, whole = args.dynamic_bucket or max(1, math.ceil(cap / 64)), 1
    if args.sequence_parallel:
        bucket = math.lcm(bucket, args.tensor_model_parallel_size)
        whole = args.tensor_model_parallel_size
    return bucket, whole


__all__ = ["DynamicGroups", "DynamicBatches", "costs_of", "bucket_of"]
