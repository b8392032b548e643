"""The dry run: the trainer's model at full size, one rank of each kind, on fake CUDA in one process.

``ulysses-mcore dryrun`` takes the ``pretrain`` flags plus ``--world-size N`` and, for each distinct
kind of rank (each pipeline stage; Megatron's tensor-parallel shards are even, so one
tensor-parallel rank stands for all), starts a fake world of N ranks as that rank
(:mod:`ulysses_mcore.devtools.fakeworld`), builds the trainer's own GPTModel (``model.build_model``:
the same spec, config and chunked loss) on fake CUDA through Megatron's real parallel state, and
runs the whole step: Megatron's DDP (its gradient buffers) and optimizer of the flags, one
optimizer step (Adam's state, as from the first step on), one micro-batch's forward through
Megatron's own code into this project's attention, the backward of every layer, and another
optimizer step.  What it reports per rank kind (:class:`RankReport`):

* the kernel each attention call took, forward and backward, and its dtypes;
* host reads and device mismatches: a run that has one stops, naming its source line;
* the peak live device bytes of the step (measured), and what is held through it -- parameters,
  DDP's gradient buffers, the optimizer's master weights and moments (measured: the bytes each
  made) -- with the forward's activation peak, beside ``ulysses-mcore plan``'s estimate;
* FLOPs counted by ``FlopCounterMode`` (causal attention as the half it computes) per phase
  (attention, the rest) beside the step-time model's count; all-to-all bytes per layer;
* the step time the step-time model predicts on a named GPU preset.

No numerics: fake tensors hold no values.  Needs torch's CUDA build (no GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams

from ulysses_mcore.devtools import fakeworld as fw
from ulysses_mcore.megatron.compat.fake_cuda import stand_ins
from ulysses_mcore.megatron.layer.batch import make_lm_batch, shard_batch
from ulysses_mcore.megatron.layer.groups import destroy, initialize
from ulysses_mcore.megatron.trainer.arguments import validate
from ulysses_mcore.megatron.trainer.dynamic import DynamicGroups
from ulysses_mcore.megatron.trainer.errors import gradient_buffers
from ulysses_mcore.megatron.trainer.model import build_model, optimizer_of
from ulysses_mcore.megatron.trainer.training import model_forward, to_device
from ulysses_mcore.planning import step_time
from ulysses_mcore.planning.memory_model import estimate
from ulysses_mcore.planning.placement import Cell
from ulysses_mcore.planning.shape import ModelShape


@dataclass
class RankReport:
    kind: str  # e.g. "pp stage 0 of 2 (rank 0)"
    rank: int
    kernels_forward: Dict[str, int]
    kernels_backward: Dict[str, int]
    params_gb: float  # measured: the parameters' bytes (DDP's parameter buffer with the distributed optimizer)
    grads_gb: float  # measured: DDP's gradient buffers
    optimizer_gb: float  # measured: the device bytes the optimizer holds (master weights, Adam's moments)
    activations_gb: float  # measured: the live device bytes the forward made, at its peak
    step_gb: float  # measured: the live device bytes the micro-batch made, at its peak (forward and backward)
    peak_gb: float  # measured: the live device bytes of the whole step at its peak
    plan: Dict[str, float]  # ulysses-mcore plan's estimate, GB
    forward_tflop: Dict[str, float]  # counted: {"attention", "total"}
    model_forward_tflop: Dict[str, float]  # the step-time model's count, same keys
    all_to_all_gb_per_layer: float  # sent by this rank, forward
    step_s: float  # the step-time model's prediction on the preset
    preset: str
    host_gb: float  # host memory of this rank: offloaded layer inputs and the optimizer's host state (measured)
    seconds: float
    peak_holders: List[str] = field(default_factory=list)  # the largest live tensors at the step's peak
    findings: List[str] = field(default_factory=list)


def rank_kinds(topo) -> List[tuple]:
    """``[(label, global rank)]``: the first rank of each pipeline stage."""
    stages = topo.groups("pp")[0]
    return [(f"pp stage {s} of {topo.pp} (rank {r})", r) for s, r in enumerate(stages)]


def _batch(args, topo, dynamic_groups):
    """This rank's micro-batch on fake CUDA: the trainer's sharding of a full sequence, or under
    --dynamic-ulysses the largest degree's cell (two documents of 3/4 and 1/4 of it)."""
    mbs, seq = args.micro_batch_size, args.seq_length
    text = torch.randint(0, 256, (mbs, seq + 1))
    if dynamic_groups is None:
        sharded = shard_batch(make_lm_batch(text), rank=ps.get_context_parallel_rank(), ulysses=topo.ulysses * topo.cp)
        return to_device(sharded, torch.device("cuda", 0)), None
    return _dynamic_cell(args, topo, dynamic_groups, text)


def _dynamic_cell(args, topo, groups, text):
    """The largest degree's cell of --dynamic-ulysses: ``U`` ranks at the fixed degree's per-rank load
    (``micro-batch x sequence / U``),
    two documents (3/4 and 1/4 of it), as the trainer hands it to the model (Megatron's
    ``PackedSeqParams`` with the cell's group)."""
    U, per_rank = topo.ulysses, args.micro_batch_size * args.seq_length // topo.ulysses  # the fixed degree's load
    total = U * per_rank
    docs = [total * 3 // 4, total - total * 3 // 4]
    mine = make_lm_batch(text.reshape(1, -1)[:, : per_rank + 1])
    cu = torch.tensor([0, docs[0], total], dtype=torch.int32)
    cell = Cell(order=0, first=0, ulysses=U, docs=(0, 1), tokens=total, per_rank=per_rank)
    mine["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=docs[0],
        max_seqlen_kv=docs[0],
        cp_group=groups.group(cell),
    )
    return to_device(mine, torch.device("cuda", 0)), docs


def _planning_records(args, topo):
    """(step_time.Run, the layout) of the flags: one micro-batch per step."""
    run = step_time.Run(
        model=ModelShape.from_args(args),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * topo.dp,
        bf16=args.bf16,
        recompute=args.recompute_granularity,
        distributed_optimizer=args.use_distributed_optimizer,
    )
    return run, topo


def model_forward_tflop(args, topo) -> Dict[str, float]:
    """The step-time model's forward FLOPs of one micro-batch per rank, by phase, TFLOP."""
    run, lay = _planning_records(args, topo)
    f = step_time.features(run, lay)
    passes = 4 if args.recompute_granularity == "full" else 3
    attn = f["attn_flops"] / passes
    rest = (f["mlp_flops"] + f["other_flops"]) / passes
    return {"attention": attn / 1e12, "total": (attn + rest) / 1e12}


def predicted_step_s(args, topo, preset: str) -> float:
    """The step-time model's seconds for this layout on ``preset``."""
    run, lay = _planning_records(args, topo)
    p = step_time.PRESETS[preset]
    return step_time.predict(step_time.gpu_rates(p), run, lay, p["gpus_per_node"])["step_s"]


def plan_estimate(args, topo) -> dict:
    """``ulysses-mcore plan``'s estimate of this layout, GB."""
    est = estimate(
        **ModelShape.from_args(args).keywords(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        tp=topo.tp,
        ulysses=topo.ulysses,
        cp=topo.cp,
        pp=topo.pp,
        bf16=args.bf16,
        recompute=args.recompute_granularity,
        distributed_optimizer=args.use_distributed_optimizer,
        dp=topo.dp,
        loss_chunk_tokens=args.loss_chunk_tokens,
        mlp_chunk_tokens=args.mlp_chunk_tokens,
        offload=args.offload_activation_checkpoints,
        optimizer_offload=args.optimizer_cpu_offload,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        bias_linear=not args.disable_bias_linear,
    )
    return {k: v / 1e9 for k, v in est.items() if k.endswith("_bytes")}


def _gradient_bytes(model) -> int:
    """DDP's gradient buffers (``errors.gradient_buffers``; a storage shared with the parameters
    counts once)."""
    return sum(st.nbytes() for st in {g.untyped_storage() for g in gradient_buffers(model)})


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers under Megatron's: each chained one's, and the host optimizers under a
    hybrid-device one (--optimizer-cpu-offload)."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return inner + [sub for o in inner for sub in getattr(o, "sub_optimizers", [])]


def _held_tensors(opt) -> list:
    """A torch optimizer's parameters, their gradients and its state tensors."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return params + [p.grad for p in params if p.grad is not None] + state


def _host_bytes(optimizer) -> int:
    """The optimizer's host memory: the storages of its parameters, their gradients and its state
    kept on the host (--optimizer-cpu-offload), each once."""
    tensors = [t for opt in _torch_optimizers(optimizer) for t in _held_tensors(opt)]
    storages = {t.untyped_storage() for t in tensors if t.device.type == "cpu"}
    return sum(st.nbytes() for st in storages)


def _optimizer_step(optimizer) -> None:
    """Megatron's optimizer step less the gradient norm: ``prepare_grads`` (the main gradients from
    DDP's buffers) and ``step_with_ready_grads`` (Adam, the copy back to the weights, the
    distributed optimizer's all-gather).  The norm for clipping ends in a host read of one scalar
    (a sync on a GPU too; fake tensors hold no value to read); clipping scales in place."""
    optimizer.prepare_grads()
    optimizer.step_with_ready_grads()


@dataclass
class _Step:
    """What one micro-batch's forward and backward showed: the kernels each way, the forward's FLOPs,
    and the live bytes the step made on the device (activations, their gradients, temporaries) at the
    forward's end and at the step's peak."""

    forward: fw.KernelLog
    backward: fw.KernelLog
    flops: object
    forward_peak: int
    step_peak: int
    holders: List[str]


def _step(model, batch, docs) -> _Step:
    """One micro-batch through the model and back: the forward under the kernel log and the FLOP
    counter, its saved tensors handed to the backward once (as the engine frees them), then the whole
    backward -- every layer, full recompute's re-forward included -- through the engine-free backward
    (parameters' gradients dropped as DDP's hooks drop them into its buffer, held throughout).  The
    live bytes the micro-batch made span both."""
    live = fw.LiveBytes()
    with fw.SdpaAsOnGpu(), live, fw.recording_function_inputs():  # Functions applied in the recompute, too
        with fw.KernelLog() as log, fw.flop_counter(docs) as flops, fw.SavedOnce():
            out = model_forward(model, batch)
        forward_peak = live.peak
        with fw.KernelLog() as back, fw.engine_free_autograd(), fw.SavedOnce():  # the recompute's, too
            fw.backward(out, torch.ones_like(out), keep=fw.not_a_parameter)
        del out
    return _Step(log, back, flops, forward_peak=forward_peak, step_peak=live.peak, holders=live.holders())


def _stage_input(model, args, batch) -> None:
    """A later pipeline stage's input: the previous stage's hidden states ``[s, b, h]`` (fake)."""
    if ps.is_pipeline_first_stage():
        return
    s, b = batch["tokens"].shape[1], batch["tokens"].shape[0]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model.set_input_tensor(torch.empty(s, b, args.hidden_size, dtype=dtype, device="cuda", requires_grad=True))


def _offloaded_gb(model) -> float:
    """--offload-activation-checkpoints: the peak host bytes the forward's hooks held (measured)."""
    stats = getattr(model, "_offload_stats", None)
    return stats["peak_host_bytes"] / 1e9 if stats else 0.0


@dataclass
class _Held:
    """Device bytes held through the step (parameters, gradient buffers, optimizer state), the
    step's peak, and the optimizer's host bytes."""

    params: int
    grads: int
    optimizer: int
    peak: int
    host: int


def _whole_step(args, topo, groups):
    """(what the step held, the micro-batch's :class:`_Step`, the model): Megatron's DDP model and
    optimizer of the flags, a first optimizer step (Adam's state, as every later step holds it),
    one micro-batch forward and backward, a second optimizer step -- all under one byte count."""
    live = fw.LiveBytes()
    with live:
        model, _ = build_model(args, vocab_size=args.vocab_size, use_cpu_initialization=False)
        grads = _gradient_bytes(model)
        params = live.now - grads
        optimizer = optimizer_of(args, model, gloo=False)
        _optimizer_step(optimizer)
        states = live.now - params - grads
        batch, docs = _batch(args, topo, groups)
        _stage_input(model.module, args, batch)
        step = _step(model, batch, docs)
        _optimizer_step(optimizer)
    return _Held(params, grads, states, live.peak, _host_bytes(optimizer)), step, model


def run_rank(args, topo, label: str, rank: int, preset: str = "h100") -> RankReport:
    """One rank kind: a fresh fake world as ``rank``, the model, its whole training step."""
    t0 = time.perf_counter()
    with fw.fake_world(topo.world_size, rank=rank), stand_ins():
        dynamic = args.dynamic_ulysses
        initialize(
            tp=topo.tp,
            ulysses=1 if dynamic else topo.ulysses,
            cp=topo.cp,
            pp=topo.pp,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups,
            seq_length=args.seq_length,
            verbose=False,
            gloo_groups=False,
        )
        groups = None
        if dynamic:
            groups = DynamicGroups(topo.world_size, topo.tp, topo.ulysses)
        try:
            held, step, model = _whole_step(args, topo, groups)
        finally:
            if groups is not None:
                groups.destroy()
            destroy()
    host = held.host / 1e9 + _offloaded_gb(model.module)
    counted = step.flops.get_flop_counts().get("Global", {})
    attn = sum(v for op, v in counted.items() if "attention" in str(op) or "varlen" in str(op))
    return RankReport(
        kind=label,
        rank=rank,
        kernels_forward=step.forward.kernels(),
        kernels_backward=step.backward.kernels("backward"),
        params_gb=held.params / 1e9,
        grads_gb=held.grads / 1e9,
        optimizer_gb=held.optimizer / 1e9,
        activations_gb=step.forward_peak / 1e9,
        step_gb=step.step_peak / 1e9,
        peak_gb=held.peak / 1e9,
        plan=plan_estimate(args, topo),
        forward_tflop={"attention": attn / 1e12, "total": step.flops.get_total_flops() / 1e12},
        model_forward_tflop=model_forward_tflop(args, topo),
        all_to_all_gb_per_layer=step.forward.all_to_all_bytes / max(args.num_layers // topo.pp, 1) / 1e9,
        step_s=predicted_step_s(args, topo, preset),
        preset=preset,
        host_gb=host,
        seconds=time.perf_counter() - t0,
        peak_holders=step.holders,
    )


FSDP2_UNSIZED = (
    "--use-torch-fsdp2: the dry run cannot build torch's DeviceMesh on fake tensors (its constructor reads "
    "the ranks back from a tensor); size the layout with --use-distributed-optimizer instead (gradients and "
    "Adam's state sharded over the same ranks; FSDP2 shards the weights too)"
)


def run(args, world_size: int, preset: str = "h100") -> List[RankReport]:
    """Every rank kind of the layout the flags give at ``world_size`` ranks."""
    if args.use_torch_fsdp2:
        raise ValueError(FSDP2_UNSIZED)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage: the dry run sizes one model chunk a pipeline stage (the "
            "interleaved schedule's extra micro-batches in flight are not modelled): drop the flag to size the "
            "same layers"
        )
    topo = validate(args, world_size)
    return [run_rank(args, topo, label, rank, preset) for label, rank in rank_kinds(topo)]


__all__ = ["RankReport", "run", "run_rank", "rank_kinds", "plan_estimate"]
