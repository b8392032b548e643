"""The trainer's command line: Megatron-LM's flag names and defaults, a help line for each, and the
run's configuration as one frozen, typed record of them (:func:`trainer_config`).

The checks of the values (:func:`~ulysses_mcore.megatron.trainer.arguments.validate`) are
:mod:`~ulysses_mcore.megatron.trainer.arguments`'.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Optional

from ulysses_mcore.devtools.flags import explain


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--ulysses-degree", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument(
        "--dynamic-ulysses",
        action="store_true",
        help="a Ulysses degree per document (powers of two up to --ulysses-degree), placed per global batch "
        "by the cost model; needs --reset-attention-mask (docs/dynamic.md)",
    )
    g.add_argument(
        "--calibration",
        "--dynamic-calibration",
        dest="calibration",
        default=None,
        help="--dynamic-ulysses: the cost model's rates from `ulysses-mcore fit --out DIR` (DIR/calibration.json); "
        "default: the project's CPU calibration on a CPU, the H200 preset on a GPU",
    )
    g.add_argument(
        "--dynamic-bucket",
        type=int,
        default=None,
        help="--dynamic-ulysses: a cell's tokens per rank rounded up to a multiple of this (few shapes a run); "
        "default: the per-rank load / 64",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="collective timeout: a dead peer fails the others within it",
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention with --num-query-groups KV heads (1 if not given)",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="KV heads (implies --group-query-attention here; Megatron-LM needs both)",
    )
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (ffn default int(8h/3 / 64) * 64, as Megatron-LM)")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output layer (default: tied to the input embedding, as Megatron-LM)",
    )
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="default 0 here (Megatron-LM: 0.1); dropout masks depend on the layout",
    )
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="default 0 here (Megatron-LM: 0.1)")
    g.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="Megatron-Core's local spec (plain torch, CPU) or Transformer Engine's (GPU)",
    )
    g.add_argument(
        "--use-mcore-models",
        action="store_true",
        help="accepted for Megatron-LM command lines; the model is always Megatron-Core's GPTModel",
    )
    g.add_argument("--attention-backend", choices=["auto", "sdpa", "flash", "te"], default="auto")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        help="compute the output layer and cross-entropy this many tokens at a time: at most one "
        "chunk's logits [C, vocab/tp] exist (default: off, Megatron's whole logits)",
    )
    g.add_argument(
        "--mlp-chunk-tokens",
        type=int,
        default=None,
        help="run each MLP over this many tokens at a time, recomputing the chunk's "
        "intermediates in backward: no whole [tokens, ffn/tp] intermediate (default: off)",
    )
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary before padding, at least the tokenizer's 258 ids (Megatron-LM's flag; "
        "e.g. 128256 sizes Llama 3's embedding and output layer; the data stay byte tokens; default: 258)",
    )
    g.add_argument(
        "--offload-activation-checkpoints",
        action="store_true",
        help="keep the tensors the forward saves for the backward (with --recompute-granularity full: each "
        "layer's input) in pinned host memory, prefetched back one layer ahead in the backward (ALST's "
        "offload; on a CPU the same copies are made host to host)",
    )
    _memory_flags(p.add_argument_group("memory, overlap and sharding (Megatron-LM's flags; docs/memory.md)"))
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=3)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear"
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--on-nan",
        choices=["stop", "skip"],
        default="stop",
        help="NaN/Inf in loss or gradients: stop the run, or skip that update",
    )
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None, help="prefix of a .bin/.idx indexed dataset")
    g.add_argument("--split", default="98,2,0")
    g.add_argument("--tokenizer-type", choices=["ByteTokenizer"], default="ByteTokenizer")
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="documents (split at EOD) do not attend to each other: each micro-batch is packed "
        "into one THD stream with cu_seqlens (no [s, s] mask is ever built)",
    )
    g.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="position ids restart after each EOD (learned absolute embeddings; RoPE is relative)",
    )
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-dir", default=None, help="CSV metrics go here (default: --save or runs/)")
    g.add_argument(
        "--timing",
        action="store_true",
        help="time the step's phases (all-to-alls, ring, attention kernel, MLP, optimizer) and bytes sent, "
        "per rank and iteration, into timing_rank<R>.jsonl beside metrics.csv",
    )
    g.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="on --load, use this command line's learning-rate schedule (--lr, --min-lr, --train-iters, "
        "--lr-warmup-iters, ...) instead of the checkpoint's",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        dest="use_checkpoint_opt_param_scheduler",
        help="on --load, keep the checkpoint's learning-rate schedule (without either flag a "
        "difference is an error, as in Megatron-LM)",
    )
    g = p.add_argument_group("exiting (Megatron-LM's flags)")
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM: finish the current iteration, save (with --save) and exit 0",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save (with --save) and exit 0 when the iteration is a multiple of this",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="save (with --save) and exit 0 after the first iteration that ends this many minutes after start",
    )
    explain(p, FLAG_HELP)
    return p


def _memory_flags(g) -> None:
    """Megatron-LM's memory and communication features, by its names (docs/memory.md says which run
    on CPU and which are refused there, and why)."""
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--fine-grained-activation-offloading", action="store_true")
    g.add_argument("--offload-modules", nargs="*", default=None)
    g.add_argument("--use-megatron-fsdp", action="store_true")
    g.add_argument("--use-torch-fsdp2", action="store_true")


# flag -> (lowest allowed value, what it means); None flags are "not given"
FLAG_HELP = {  # the help line of each flag that does not carry its own (Megatron-LM's meanings)
    "--tensor-model-parallel-size": "tensor-parallel ranks: the weights of each layer split over them "
    "(default: %(default)s)",
    "--pipeline-model-parallel-size": "pipeline stages: the layers split into this many stages (default: %(default)s)",
    "--ulysses-degree": "Ulysses sequence-parallel ranks: tokens sharded over them, heads inside attention "
    "(the all-to-all; must divide the heads per tensor-parallel rank; default: %(default)s)",
    "--context-parallel-size": "ring context-parallel ranks outside the Ulysses groups (the log-sum-exp ring; "
    "default: %(default)s)",
    "--sequence-parallel": "Megatron's sequence parallelism inside tensor parallelism (norms and dropout on "
    "sequence shards; needs Transformer Engine or apex norms: GPU)",
    "--use-distributed-optimizer": "shard the optimizer state over the data-parallel x Ulysses x ring ranks "
    "(Megatron's distributed optimizer)",
    "--num-layers": "transformer layers (default: %(default)s)",
    "--hidden-size": "hidden size (default: %(default)s)",
    "--ffn-hidden-size": "MLP hidden size (default: 4 x hidden, or int(8 x hidden / 3 / 64) x 64 with --swiglu)",
    "--num-attention-heads": "query heads (default: %(default)s)",
    "--seq-length": "tokens per sample (default: %(default)s)",
    "--max-position-embeddings": "longest position the model embeds (default: --seq-length)",
    "--position-embedding-type": "rope (rotary, applied per shard at global positions) or learned_absolute "
    "(default: %(default)s)",
    "--normalization": "LayerNorm or RMSNorm (default: %(default)s)",
    "--kv-channels": "channels of each attention head (default: --hidden-size / --num-attention-heads; Qwen3: 128)",
    "--qk-layernorm": "normalise queries and keys per head before attention (Qwen3, OLMo 2)",
    "--init-method-std": "standard deviation of the initial weights (default: %(default)s)",
    "--attention-backend": "the kernel inside Ulysses attention: auto (te with --transformer-impl "
    "transformer_engine, else sdpa), sdpa, flash (flash-attn), te (default: %(default)s)",
    "--recompute-granularity": "activation recompute: full (each layer's input kept, the layer recomputed in "
    "the backward) or selective (Megatron's core-attention recompute)",
    "--recompute-method": "with --recompute-granularity full: uniform (every --recompute-num-layers layers "
    "one checkpoint) or block (the first --recompute-num-layers layers of each stage recomputed; default uniform)",
    "--recompute-num-layers": "with --recompute-granularity full: layers per checkpoint (uniform) or recomputed "
    "layers per stage (block; default 1)",
    "--overlap-grad-reduce": "reduce each gradient bucket while the backward goes on (Megatron's DDP)",
    "--overlap-param-gather": "all-gather the updated weights during the next forward (needs "
    "--use-distributed-optimizer and --overlap-grad-reduce)",
    "--grad-reduce-in-bf16": "reduce gradients in bf16 instead of fp32 (needs --bf16)",
    "--num-layers-per-virtual-pipeline-stage": "interleaved pipeline: layers per model chunk (a stage holds "
    "two or more chunks; Megatron's interleaved schedule; no checkpoints yet)",
    "--num-experts": "MoE: experts per MoE layer (every layer; Megatron's SequentialMLP experts; GPU)",
    "--expert-model-parallel-size": "MoE: ranks the experts are split over (default: %(default)s)",
    "--moe-router-topk": "MoE: experts per token (default: %(default)s)",
    "--optimizer-cpu-offload": "Adam's state and step on the host (Megatron's hybrid-device optimizer; GPU)",
    "--fine-grained-activation-offloading": "offload the activations of --offload-modules to host memory "
    "(Megatron's fine-grained offloading; needs CUDA streams: GPU)",
    "--offload-modules": "with --fine-grained-activation-offloading: Megatron's module names (e.g. "
    "attn_norm core_attn attn_proj mlp_norm expert_fc1 moe_act)",
    "--use-megatron-fsdp": "Megatron-FSDP (Megatron-LM's script through megatron_patches; this trainer refuses it)",
    "--use-torch-fsdp2": "shard weights, gradients and Adam's state over the data-parallel x Ulysses ranks with "
    "torch FSDP2 (Megatron's wrapper; megatron-core 0.17+, untied embeddings, no checkpoints yet)",
    "--bf16": "bf16 weights and activations (fp32 gradients buffer, master weights and Adam state)",
    "--make-vocab-size-divisible-by": "pad the vocabulary to a multiple of this (default: %(default)s)",
    "--micro-batch-size": "samples per micro-batch on each data-parallel rank (default: %(default)s)",
    "--global-batch-size": "samples per optimizer step over all data-parallel ranks (default: %(default)s)",
    "--train-iters": "optimizer steps to run (default: %(default)s)",
    "--lr": "peak learning rate (default: %(default)s)",
    "--min-lr": "learning rate at the end of the decay (default: %(default)s)",
    "--lr-warmup-iters": "steps of linear warm-up from 0 (default: %(default)s)",
    "--clip-grad": "gradient-norm clipping threshold (default: %(default)s)",
    "--lr-decay-style": "learning-rate decay after the warm-up (default: %(default)s)",
    "--weight-decay": "AdamW weight decay (default: %(default)s)",
    "--adam-beta1": "Adam beta1 (default: %(default)s)",
    "--adam-beta2": "Adam beta2 (default: %(default)s)",
    "--adam-eps": "Adam epsilon (default: %(default)s)",
    "--seed": "random seed: the same initial model for every layout (default: %(default)s)",
    "--split": "train,validation,test weights of the documents (default: %(default)s; every split of "
    "non-zero weight needs at least one document)",
    "--tokenizer-type": "the byte-level tokenizer (the only one: no download)",
    "--save": "folder to save checkpoints to (Megatron's dist_checkpointing; any layout can resume them)",
    "--load": "folder to resume from (its latest checkpoint; another tp / ulysses / cp / pp is fine)",
    "--save-interval": "save every this many steps (default: only at the end, when --save is given)",
    "--eval-interval": "evaluate on the validation split every this many steps (default: only at the end)",
    "--eval-iters": "validation micro-batch rounds per evaluation (default: %(default)s)",
    "--log-interval": "print an iteration line every this many steps (default: %(default)s)",
}


def trainer_config(args: argparse.Namespace):
    """The run's flags as one frozen record, built once (after the checks) and passed down: a field per
    flag under Megatron-LM's name (``args.seq_length``, as before), typed as the parser reads it, and
    no module can change a flag behind the others' backs (assigning one raises)."""
    return _record_class(tuple(vars(args)))(**vars(args))


@functools.cache
def _record_class(names):
    """``TrainerConfig``: a frozen dataclass of ``names`` (the parser's destinations, and the extras
    of a command that adds flags), each typed by its parser action."""
    types = {a.dest: _type_of(a) for a in build_parser()._actions}
    return dataclasses.make_dataclass("TrainerConfig", [(n, types.get(n, Any)) for n in names], frozen=True)


def _type_of(action: argparse.Action):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return bool
    kind = action.type if isinstance(action.type, type) else (str if action.type is None else Any)
    if action.nargs not in (None, "?"):
        kind = list
    return kind if action.default is not None else Optional[kind]
