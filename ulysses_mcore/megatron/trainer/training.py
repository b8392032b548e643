"""Megatron-Core's own training parts, wired for Ulysses: GPTModel + DDP + optimizer + schedule.

Nothing here re-implements Megatron: the model is ``GPTModel`` built from a Ulysses layer
spec, wrapped in Megatron's ``DistributedDataParallel``; the optimizer comes from
``get_megatron_optimizer``; a step is ``get_forward_backward_func()`` (pipeline schedules
with micro-batches) followed by ``optimizer.step()``.  Loss is token-weighted
(:mod:`ulysses_mcore.megatron.trainer.loss`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from ulysses_mcore.megatron.layer.groups import built_topology
from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec
from ulysses_mcore.megatron.trainer.errors import NonFiniteError, nonfinite_report
from ulysses_mcore.megatron.trainer.loss import check_config, global_mean, masked_token_loss
from ulysses_mcore.exchange.transport import is_fake_group


def _cp_levels():
    """``[ulysses, ring]`` of the layout :func:`ulysses_mcore.initialize` built, when it has a ring
    (not parallel_state's hierarchical groups: Megatron's teardown leaves them in place, so after a
    re-initialisation without a ring they would be stale)."""
    topo = built_topology()
    return [topo.ulysses, topo.cp] if topo is not None and topo.cp > 1 else None


def gpt_config(**kw):
    """A ``TransformerConfig`` with the settings sequence-sharded training needs.

    ``context_parallel_size`` is Megatron's CP size = ulysses x ring cp (from the
    initialised topology unless given), ``hierarchical_context_parallel_sizes`` its levels
    ``[ulysses, ring]`` when there is a ring (the layers split Megatron's CP group by them);
    token-weighted loss is on."""
    kw.setdefault("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size())
    kw.setdefault("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size())
    kw.setdefault("context_parallel_size", ps.get_context_parallel_world_size())
    kw.setdefault("hierarchical_context_parallel_sizes", _cp_levels())
    kw.setdefault("calculate_per_token_loss", True)
    kw.setdefault("use_cpu_initialization", not torch.cuda.is_available())
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    if kw["pipeline_model_parallel_size"] > 1:
        kw.setdefault("pipeline_dtype", kw.get("params_dtype", torch.float32))
    config_class = TransformerConfig
    if kw.get("multi_latent_attention"):  # MLA (DeepSeek-V2/V3): Megatron's own config class for it
        config_class = MLATransformerConfig
    cfg = config_class(**kw)
    check_config(cfg)
    return cfg


def training_device() -> torch.device:
    """The one device of this process's model and batches: the current CUDA device when CUDA is
    available and the process group (if any) runs on NCCL (or is torch's fake group: the dry run's
    fake CUDA), else the CPU.  The model is moved there
    before DDP wraps it (:func:`build_gpt`), every batch in the forward step (:func:`to_device`)."""
    if dist.is_initialized() and is_fake_group(None):  # the dry run: fake CUDA, no GPU
        return torch.device("cuda", 0)
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(batch: Dict, device) -> Dict:
    """A micro-batch on ``device``: its tensors and Megatron's ``PackedSeqParams`` (tensor fields
    moved, host ints such as ``max_seqlen_q`` kept), copied with ``non_blocking``."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return x if x.device == device else x.to(device, non_blocking=True)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            moved = {f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            return dataclasses.replace(x, **moved)
        return x

    return {k: move(v) for k, v in batch.items()}


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


class Chunks(list):
    """A pipeline stage's model chunks under the interleaved schedule, each a DDP-wrapped GPTModel
    (--num-layers-per-virtual-pipeline-stage): what the trainer asks of its model -- zero the
    gradient buffers, train / eval, the parameters, the gradient buffers, the param sync -- asked of
    each chunk.  Megatron's schedule and optimizer take the list itself."""

    def zero_grad_buffer(self) -> None:
        for chunk in self:
            chunk.zero_grad_buffer()

    def train(self, mode: bool = True) -> None:
        for chunk in self:
            chunk.train(mode)

    def eval(self) -> None:
        self.train(False)

    def modules(self):
        return (m for chunk in self for m in chunk.modules())

    def parameters(self):
        return (p for chunk in self for p in chunk.parameters())

    def named_parameters(self):
        return ((f"chunk{i}.{n}", p) for i, chunk in enumerate(self) for n, p in chunk.module.named_parameters())

    @property
    def buffers(self) -> list:
        return [b for chunk in self for b in chunk.buffers]

    @property
    def expert_parallel_buffers(self) -> list:
        return [b for chunk in self for b in chunk.expert_parallel_buffers]

    @property
    def ddp_config(self):
        return self[0].ddp_config

    def start_param_sync(self, force_sync: bool = False) -> None:
        for chunk in self:
            chunk.start_param_sync(force_sync=force_sync)


def chunked(model):
    """Megatron's list of model chunks: the stage's chunks, or the one model."""
    return list(model) if isinstance(model, Chunks) else [model]


def build_gpt(
    config,
    *,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = False,
    layer_spec=None,
    ddp_config=None,
    wrap_ddp: bool = True,
    vp_stage: Optional[int] = None,
):
    """Megatron's GPTModel for this pipeline stage (Ulysses core attention), in Megatron's DDP;
    ``vp_stage``: which of the stage's model chunks under the interleaved schedule (its layers, and
    whether it holds the embedding or the output layer)."""
    virtual = dict(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec if layer_spec is not None else get_ulysses_layer_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=ps.is_pipeline_first_stage(**virtual),
        post_process=ps.is_pipeline_last_stage(**virtual),
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    if config.bf16:  # as Megatron-LM's Float16Module: every weight in bf16, the torch norms' too (built in
        for p in model.parameters():  # fp32, each norm ran in fp32 and kept three fp32 [s, b, h] tensors)
            if p.is_floating_point() and p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
    device = training_device()
    if any(t.device != device for t in (*model.parameters(), *model.buffers())):
        model.to(device)  # norms, buffers (sinks) and CPU-initialised weights: before DDP sees them
    if not wrap_ddp:
        return model
    if ddp_config is None:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
    # as Megatron-LM: buckets for the first chunk only (a later chunk's grads are reduced at the step's end)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, disable_bucketing=bool(vp_stage))
    config.no_sync_func = ddp.no_sync
    if ddp_config.overlap_grad_reduce:  # as Megatron-LM's train(): the schedule starts each bucket's reduce
        config.grad_sync_func = ddp.start_grad_sync
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = ddp.start_param_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


class _FullyShardedScaled(TorchFullyShardedDataParallel):
    """Megatron's wrapper for a per-token loss, as Megatron's DDP treats one: the ranks'
    gradients summed (FSDP2 averages them by default), and the division by the step's token
    count (``finalize_model_grads``) made on the gradients' shards (the wrapper's
    ``scale_gradients`` is its base class's no-op)."""

    def scale_gradients(self, scaling_factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)


def shard_fully(model, config, *, reshard_after_forward: bool = True):
    """``model`` in Megatron's torch-FSDP2 wrapper: each layer's weights, gradients and Adam's state
    sharded over the data-parallel x context-parallel ranks (Ulysses' included), the weights
    gathered for each layer's forward and backward (``reshard_after_forward``: let go between)."""
    fsdp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=reshard_after_forward)
    fsdp = _FullyShardedScaled(config=config, ddp_config=fsdp_config, module=model)
    for module in fsdp.module.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # a module fully_shard wrapped: a plain sum
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # no pre-multiplied sum (gloo has none)
    config.no_sync_func = fsdp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return fsdp


def sync_params(model) -> None:
    """With ``overlap_param_gather`` the distributed optimizer's step leaves the all-gather of the
    updated weights to the next forward's pre-hooks: finish it now (before a checkpoint is written,
    as Megatron-LM's ``disable_forward_pre_hook`` does).  A no-op without it."""
    ddp_config = getattr(model, "ddp_config", None)
    if ddp_config is not None and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
        model.start_param_sync(force_sync=True)


def init_layout_independent(model, config, seed: int) -> int:
    """Re-draw every random weight so the initial model is the same for any tp, pp, ulysses,
    cp and dp: each weight of two or more dims is drawn at its *full* (unsharded) shape from a
    generator keyed by ``(seed, global parameter name)`` -- normal(0, ``init_method_std``),
    scaled by ``1/sqrt(2 * num_layers)`` for ``linear_proj`` / ``linear_fc2`` as Megatron's
    ``output_layer_init_method`` -- and this rank's tensor-parallel slice is kept.  Vectors
    (biases, norms) are already constants.  Megatron's own init draws from one stream per
    rank, so a pipeline stage's layers (and tp shards) depend on the layout; this does not.
    Call before the optimizer is built (it copies the weights).  Returns the count re-drawn."""
    if isinstance(model, Chunks):  # each chunk's layers by their global numbers
        return sum(init_layout_independent(chunk, config, seed) for chunk in model)
    core = model.module if hasattr(model, "module") else model
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    std = config.init_method_std
    scaled = std / math.sqrt(2.0 * config.num_layers)
    count = 0
    for name, p in core.named_parameters():
        if p.dim() < 2:
            continue
        key = global_layer_name(core, name)
        if key == "output_layer.weight" and getattr(core, "share_embeddings_and_output_weights", False):
            key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
        digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
        shape = list(p.shape)
        if dim >= 0:
            shape[dim] *= tp
        full = torch.empty(shape, dtype=torch.float32).normal_(
            0.0, scaled if key.endswith(("linear_proj.weight", "linear_fc2.weight")) else std, generator=gen
        )
        if dim >= 0:
            halves = [full]
            if config.gated_linear_unit and key.endswith("linear_fc1.weight"):
                halves = full.chunk(2, dim)  # [gate; up]: each rank holds a slice of each
            full = torch.cat([h.chunk(tp, dim)[tp_rank] for h in halves], dim)
        with torch.no_grad():
            p.copy_(full)
        count += 1
    return count


def build_optimizer(
    model,
    *,
    lr: float = 1e-3,
    min_lr: float = 0.0,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    optimizer_cpu_offload: bool = False,
    gloo: bool = True,
):
    """Megatron's optimizer (Adam) over ``model``'s parameters; ``use_distributed_optimizer`` must
    match the DDP wrapper's (its buffers are sharded for it); ``optimizer_cpu_offload``: Megatron's
    hybrid-device optimizer keeps Adam's state and step on the host (GPU only); ``gloo``: Megatron's
    gloo groups exist (a fake world has none)."""
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True)
    offload = offload if optimizer_cpu_offload else {}
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        **offload,
    )
    return get_megatron_optimizer(cfg, chunked(model), use_gloo_process_groups=gloo)


def model_forward(model, batch: Dict):
    """The GPTModel's forward on one micro-batch (its tokens, positions, mask, labels and packed
    sequence parameters): the per-token losses on the last stage, hidden states before it."""
    return model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        packed_seq_params=batch.get("packed_seq_params"),
    )


def _forward_step(data_iterator, model):
    batch = to_device(next(data_iterator), _model_device(model))
    return model_forward(model, batch), partial(masked_token_loss, batch["loss_mask"])


def forward_backward(
    model,
    microbatches: List[Dict[str, torch.Tensor]],
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
):
    """Megatron's schedule over already-sharded micro-batches; returns the loss reports."""
    fb = get_forward_backward_func()
    chunks = chunked(model)  # the interleaved schedule: each chunk reads the micro-batches in order
    return fb(
        forward_step_func=_forward_step,
        data_iterator=[iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches),
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(
    model,
    optimizer,
    microbatches,
    *,
    seq_length: int,
    micro_batch_size: int,
    scheduler=None,
    increment: int = 0,
    iteration=None,
    on_nonfinite: str = "stop",
) -> Dict[str, float]:
    """One optimizer step; returns the global token-weighted loss (on every rank), grad norm.

    Before the optimizer steps, every rank checks its loss and gradients for NaN/Inf and
    the world agrees (one all-reduce of two numbers): ``on_nonfinite="stop"`` raises
    :class:`NonFiniteError` on every rank, ``"skip"`` skips this update (Megatron-LM's
    behaviour for a bad step) and reports it."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    reports = forward_backward(model, microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size)
    loss, count = _loss_on_all_ranks(reports)
    bad, message = nonfinite_report(model, loss, iteration)
    if bad:
        if on_nonfinite == "stop":
            raise NonFiniteError(message + " (stopping: --on-nan stop)")
        model.zero_grad_buffer()
        optimizer.zero_grad()
        return {
            "loss": loss,
            "tokens": count,
            "grad_norm": float("nan"),
            "update_successful": False,
            "skipped": True,
            "message": message,
        }
    ok, grad_norm, _ = optimizer.step()
    if scheduler is not None and ok:
        scheduler.step(increment=increment)
    return {
        "loss": loss,
        "tokens": count,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "update_successful": bool(ok),
        "skipped": False,
    }


def _loss_on_all_ranks(reports):
    """Global mean loss, computed on the last stage and broadcast to every pipeline stage."""
    val = torch.zeros(2, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        loss, count = global_mean(reports)
        val = torch.tensor([loss, count], dtype=torch.float64)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        val = val.to(dev)
        dist.broadcast(
            val, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        val = val.cpu()
    return val[0].item(), int(val[1].item())


def evaluate(model, microbatches, *, seq_length: int, micro_batch_size: int) -> float:
    """Token-weighted loss without gradients."""
    model.eval()
    with torch.no_grad():
        reports = forward_backward(
            model, microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=True
        )
    model.train()
    return _loss_on_all_ranks(reports)[0]


def global_layer_name(model, name: str) -> str:
    """Parameter name with the local layer index replaced by the global one (pipeline stages)."""
    m = re.match(r"(.*decoder\.layers\.)(\d+)(\..*)", name)
    if not m:
        return name
    core = model.module if hasattr(model, "module") else model
    layer = core.decoder.layers[int(m.group(2))]
    return f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"


__all__ = [
    "gpt_config",
    "training_device",
    "to_device",
    "build_gpt",
    "Chunks",
    "chunked",
    "init_layout_independent",
    "build_optimizer",
    "shard_fully",
    "sync_params",
    "forward_backward",
    "train_step",
    "evaluate",
    "global_layer_name",
    "NonFiniteError",
]
