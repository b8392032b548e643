"""The trainer's model: Megatron's GPTModel from the Ulysses layer spec, in Megatron's DDP, with its
optimizer and learning-rate schedule -- the same initial model for every layout (one --seed).  The
dry run builds the same model (:func:`build_model`)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ulysses_mcore.megatron.layer.memory import enable_chunked_loss
from ulysses_mcore.megatron.layer.offload import checkpoint_min_bytes, enable_activation_offload
from ulysses_mcore.megatron.layer.rotary import DynamicOptions
from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec
from ulysses_mcore.megatron.trainer import training
from ulysses_mcore.megatron.trainer.arguments import padded_vocab
from ulysses_mcore.megatron.trainer.checkpoint import schedule_from_flags
from ulysses_mcore.planning.shape import ModelShape


class Trainable(NamedTuple):
    """What a training run updates: the DDP-wrapped GPTModel, its Megatron optimizer and LR scheduler."""

    model: Any
    optimizer: Any
    scheduler: Any


def build_trainable(args):
    """(DDP GPTModel, Megatron optimizer, Megatron LR scheduler) of the flags; the same initial
    model for every tp / pp / ulysses / cp / dp layout (one --seed)."""
    model, cfg = build_model(args, wrap_ddp=not args.use_torch_fsdp2)
    training.init_layout_independent(model, cfg, args.seed)  # before FSDP2 shards the weights
    if args.use_torch_fsdp2:
        model = training.shard_fully(model, cfg)
    optimizer = optimizer_of(args, model)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        **schedule_from_flags(args),  # the values a checkpoint's schedule is checked against
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
    )
    return Trainable(model, optimizer, scheduler)


def optimizer_of(args, model, *, gloo: bool = True):
    """Megatron's optimizer of the flags over the DDP-wrapped ``model`` (``gloo=False``: no gloo
    groups, as in the dry run's fake world)."""
    return training.build_optimizer(
        model,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        use_distributed_optimizer=args.use_distributed_optimizer,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        gloo=gloo,
    )


def build_model(args, *, vocab_size=None, wrap_ddp: bool = True, **config):
    """(GPTModel of the flags, in Megatron's DDP unless ``wrap_ddp=False``; its TransformerConfig):
    the trainer's model, also the dry run's (``vocab_size``: another vocabulary than the byte
    tokenizer's; ``config``: TransformerConfig keywords over the flags')."""
    te = args.transformer_impl == "transformer_engine"
    backend = args.attention_backend if args.attention_backend != "auto" else ("te" if te else "sdpa")
    cfg = training.gpt_config(**(_config_of(args) | config))
    dynamic = None
    if args.dynamic_ulysses:  # RoPE moves into the attention, after the exchange (docs/dynamic.md)
        dynamic = DynamicOptions(args.ulysses_degree, rope=args.position_embedding_type == "rope")
    build = functools.partial(
        training.build_gpt,
        cfg,
        vocab_size=vocab_size or padded_vocab(args),  # padded independently of tp: checkpoints reshard
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        position_embedding_type="none" if dynamic and dynamic.rope else args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        layer_spec=get_ulysses_layer_spec(
            "te" if (te or backend == "te") else "local",
            backend=backend,
            normalization=args.normalization,
            mlp_chunk_tokens=args.mlp_chunk_tokens,
            dynamic=dynamic,
            qk_layernorm=args.qk_layernorm,
            num_experts=args.num_experts,
        ),
        ddp_config=ddp_config_of(args) if wrap_ddp else None,
        wrap_ddp=wrap_ddp,
    )
    stages = virtual_stages(args)
    if stages is None:
        model = build()
        _memory_hooks(args, model.module if wrap_ddp else model)
        return model, cfg
    chunks = training.Chunks(build(vp_stage=i) for i in range(stages))
    offloaded = None  # the stage's one record of its chunks' host memory
    for chunk in chunks:
        offloaded = _memory_hooks(args, chunk.module, offloaded)
    _chunk_sync_funcs(cfg, chunks)
    return chunks, cfg


def virtual_stages(args):
    """Model chunks per pipeline stage under --num-layers-per-virtual-pipeline-stage (None without)."""
    per_stage = args.num_layers_per_virtual_pipeline_stage
    return None if per_stage is None else args.num_layers // args.pipeline_model_parallel_size // per_stage


def _chunk_sync_funcs(cfg, chunks) -> None:
    """The schedule's hooks per chunk, as Megatron-LM's ``train()`` sets them for the interleaved
    schedule: each chunk's no-sync, grad sync and param sync."""
    cfg.no_sync_func = [c.no_sync for c in chunks]
    if chunks.ddp_config.overlap_grad_reduce:
        cfg.grad_sync_func = [c.start_grad_sync for c in chunks]
    if chunks.ddp_config.overlap_param_gather and chunks.ddp_config.align_param_gather:
        cfg.param_sync_func = [c.start_param_sync for c in chunks]


def _memory_hooks(args, core, offloaded=None):
    """The chunked loss and the activation offload on the built GPTModel, when their flags ask: the
    offload's stats record (``offloaded``: one to count in), or None."""
    if args.loss_chunk_tokens:
        enable_chunked_loss(core, args.loss_chunk_tokens)
    if args.offload_activation_checkpoints:
        sp = args.tensor_model_parallel_size if args.sequence_parallel else 1
        shards = args.ulysses_degree * args.context_parallel_size * sp
        least = checkpoint_min_bytes(args.seq_length, args.micro_batch_size, args.hidden_size, shards, args.bf16)
        return enable_activation_offload(core, min_bytes=least, stats=offloaded)
    return None


def ddp_config_of(args) -> DistributedDataParallelConfig:
    """Megatron's DDP settings of Megatron-LM's flags (its ``get_model``): the distributed optimizer's
    sharded buffers, overlapped grad reduce (buckets of max(40M, 1M x dp x cp) elements, one bucket
    without overlap) and param gather (aligned over the pipeline stages), the reduction's dtype."""
    overlap = args.overlap_grad_reduce
    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        overlap_grad_reduce=overlap,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=max(40_000_000, 1_000_000 * dp_cp) if overlap else None,
    )


def _recompute_of(args) -> dict:
    """Megatron's recompute keywords: --recompute-granularity full re-runs --recompute-num-layers
    layers (default 1) --recompute-method uniform (default) or block; selective the core attention."""
    if args.recompute_granularity != "full":
        return dict(recompute_granularity=args.recompute_granularity)
    return dict(
        recompute_granularity="full",
        recompute_method=args.recompute_method or "uniform",
        recompute_num_layers=args.recompute_num_layers or 1,
    )


def _memory_of(args) -> dict:
    """Megatron's MoE and fine-grained activation offloading keywords of the flags (none when off)."""
    out = {}
    if args.num_experts:
        out |= dict(
            num_moe_experts=args.num_experts,
            expert_model_parallel_size=args.expert_model_parallel_size,
            moe_router_topk=args.moe_router_topk,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall" if args.expert_model_parallel_size > 1 else "allgather",
        )
    if args.fine_grained_activation_offloading:
        out |= dict(fine_grained_activation_offloading=True, offload_modules=list(args.offload_modules or []))
    return out


def _config_of(args) -> dict:
    """Megatron TransformerConfig keywords of the flags."""
    ffn = ModelShape.from_args(args, vocab_size=padded_vocab(args)).ffn_hidden_size  # Megatron-LM's default
    stages = virtual_stages(args)
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        sequence_parallel=args.sequence_parallel,
        transformer_impl=args.transformer_impl,  # Megatron-LM passes it (FSDP2 wraps by it)
        virtual_pipeline_model_parallel_size=stages,
        # Megatron-LM's default under the interleaved schedule: p2p ops one by one, overlapped; batched, a
        # pipeline of 2 sends and receives between the same two ranks in one batch, which gloo can mismatch
        overlap_p2p_comm=stages is not None,
        batch_p2p_comm=stages is None,
        **_recompute_of(args),
        **_memory_of(args),
    )
