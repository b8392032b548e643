"""The trainer's flags checked: every check that needs no collective (the parser: :mod:`.parser`).

:func:`validate` runs on every rank before torch.distributed starts, on the flags alone (and
the file system, for the output paths), so a bad flag gives the same message on every rank
and no rank waits in a collective for a peer that has exited.  Each message names the flag,
the value and the fix.
"""

from __future__ import annotations

import math
import os
from importlib.metadata import version

import torch

from ulysses_mcore.megatron.trainer.parser import build_parser
from ulysses_mcore.planning.calibration import Calibration, CalibrationError
from ulysses_mcore.topology import Topology

_INT_MIN = {
    "num_layers": 1,
    "hidden_size": 1,
    "num_attention_heads": 1,
    "seq_length": 1,
    "micro_batch_size": 1,
    "global_batch_size": 1,
    "train_iters": 1,
    "log_interval": 1,
    "expert_model_parallel_size": 1,
    "moe_router_topk": 1,
    "make_vocab_size_divisible_by": 1,
    "eval_iters": 0,
    "lr_warmup_iters": 0,
    "seed": 0,
}
_OPTIONAL_INT_MIN = {
    "ffn_hidden_size": 1,
    "num_query_groups": 1,
    "max_position_embeddings": 1,
    "save_interval": 1,
    "eval_interval": 1,
    "exit_interval": 1,
    "loss_chunk_tokens": 1,
    "mlp_chunk_tokens": 1,
    "recompute_num_layers": 1,
    "num_layers_per_virtual_pipeline_stage": 1,
    "num_experts": 1,
    "kv_channels": 1,
}
_NOTES = {
    "eval_iters": " (0: no evaluation)",
    "lr_warmup_iters": " (0: no warmup)",
    "num_query_groups": " (the number of KV heads)",
}
# float flags: (low, low inclusive?, high, high inclusive?)
_FLOAT_RANGE = {
    "lr": (0.0, True, math.inf, False),
    "min_lr": (0.0, True, math.inf, False),
    "clip_grad": (0.0, True, math.inf, False),
    "weight_decay": (0.0, True, math.inf, False),
    "adam_beta1": (0.0, True, 1.0, False),
    "adam_beta2": (0.0, True, 1.0, False),
    "adam_eps": (0.0, False, math.inf, False),
    "init_method_std": (0.0, False, math.inf, False),
    "attention_dropout": (0.0, True, 1.0, False),
    "hidden_dropout": (0.0, True, 1.0, False),
    "distributed_timeout_minutes": (0.0, False, math.inf, False),
    "exit_duration_in_mins": (0.0, False, math.inf, False),
}
_FLOAT_NOTES = {
    "clip_grad": " (0: no clipping)",
    "distributed_timeout_minutes": " (how long a collective waits for a peer)",
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _interval(lo, lo_in, hi, hi_in):
    left = "[" if lo_in else "("
    right = "]" if hi_in else ")"
    return f"{left}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}{right}"


def parse_split(text: str):
    """Megatron-LM's --split: up to three non-negative weights (train, valid, test), ',' or '/'
    separated; returns the three weights or raises ValueError naming the flag."""
    fix = "give up to three non-negative weights (train,valid,test) like 98,2,0 with a positive train weight"
    parts = text.replace("/", ",").split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        raise ValueError(f"--split {text}: not a list of numbers; {fix}") from None
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--split {text}: {fix}")
    weights += [0.0] * (3 - len(weights))
    if weights[0] <= 0:
        raise ValueError(f"--split {text}: the training weight is 0, so there is nothing to train on; {fix}")
    return weights


def check_ranges(args) -> None:
    """Each flag on its own: integers >= their minimum, floats finite and in range."""
    for name, lo in _INT_MIN.items():
        v = getattr(args, name)
        if v < lo:
            raise ValueError(f"{flag(name)} must be >= {lo}{_NOTES.get(name, '')}, got {v}")
    for name, lo in _OPTIONAL_INT_MIN.items():
        v = getattr(args, name)
        if v is not None and v < lo:
            raise ValueError(
                f"{flag(name)} must be >= {lo}{_NOTES.get(name, '')}, got {v}; leave it out for the default"
            )
    if args.seed >= 2**32:
        raise ValueError(f"--seed must be < 2**32 (numpy's seed range), got {args.seed}")
    for name, (lo, lo_in, hi, hi_in) in _FLOAT_RANGE.items():
        v = getattr(args, name)
        if v is None:
            continue
        ok = math.isfinite(v) and (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)
        if not ok:
            raise ValueError(
                f"{flag(name)} must be a finite number in {_interval(lo, lo_in, hi, hi_in)}"
                f"{_FLOAT_NOTES.get(name, '')}, got {v}"
            )
    parse_split(args.split)


def _virtual_problem(a, t) -> str:
    """Why the interleaved schedule cannot run these flags ("" if it can); ``t``: the layout."""
    pp, per = a.pipeline_model_parallel_size, a.num_layers_per_virtual_pipeline_stage
    stage = a.num_layers // pp
    micro = a.global_batch_size // (a.micro_batch_size * t.dp)
    rules = (
        (pp < 2, "the interleaved schedule needs --pipeline-model-parallel-size 2 or more"),
        (per < 1 or stage % per, f"a stage's {stage} layers must split into chunks of this many: pass a divisor"),
        (per >= 1 and stage // per < 2, f"a stage's {stage} layers make one chunk: pass at most {stage // 2}"),
        (micro % pp, f"the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size "
         f"{pp}; a step has {micro} a rank: make --global-batch-size a multiple of {pp} x micro-batch x dp"),
    )  # fmt: skip
    return next((why for broken, why in rules if broken), "")


def _megatron_core() -> tuple:
    """megatron-core's (major, minor) installed."""
    return tuple(int(p) for p in version("megatron-core").split(".")[:2])


_FSDP2_RULES = (  # Megatron-LM's rules for --use-torch-fsdp2: (flag, broken when, why)
    ("pipeline_model_parallel_size", lambda v: v > 1, "--pipeline-model-parallel-size: FSDP2 runs one stage "
     "(Megatron-LM's rule); drop pipeline parallelism"),
    ("expert_model_parallel_size", lambda v: v > 1, "--expert-model-parallel-size (Megatron-LM's rule)"),
    ("use_distributed_optimizer", bool, "--use-distributed-optimizer: FSDP2 shards Adam's state itself; drop it"),
    ("overlap_grad_reduce", bool, "--overlap-grad-reduce: DDP's buckets; FSDP2 overlaps its own reduce-scatter"),
    ("untie_embeddings_and_output_weights", lambda v: not v, "tied embeddings: add "
     "--untie-embeddings-and-output-weights (Megatron-LM's rule)"),
)  # fmt: skip


def _fsdp2_conflict(a) -> str:
    """The first of Megatron-LM's FSDP2 rules the flags break ("" if none)."""
    return next((why for name, broken, why in _FSDP2_RULES if broken(getattr(a, name))), "")


# a CPU run: no CUDA, and not the dry run (its fake CUDA sizes what a GPU runs)
_cpu = lambda a: not torch.cuda.is_available() and not getattr(a, "fake_cuda", False)  # noqa: E731
# Megatron-LM's memory features (docs/memory.md): each rule as Megatron-LM states it, then each feature that
# cannot run here, refused by name with the reason before any process group starts
_MEMORY_RULES = (
    (
        lambda a, t: (a.recompute_method or a.recompute_num_layers) and a.recompute_granularity != "full",
        lambda a, t: (
            f"--recompute-method / --recompute-num-layers ({a.recompute_method}, {a.recompute_num_layers}) choose "
            "which layers full recompute re-runs: add --recompute-granularity full"
        ),
    ),
    (
        lambda a, t: (
            a.recompute_method == "block"
            and (a.recompute_num_layers or 1) > a.num_layers // a.pipeline_model_parallel_size
        ),
        lambda a, t: (
            f"--recompute-method block --recompute-num-layers {a.recompute_num_layers}: a pipeline stage has only "
            f"{a.num_layers // a.pipeline_model_parallel_size} layers; pass at most that many"
        ),
    ),
    (
        lambda a, t: a.overlap_param_gather and not (a.use_distributed_optimizer and a.overlap_grad_reduce),
        lambda a, t: (
            "--overlap-param-gather all-gathers the distributed optimizer's updated shards: it needs "
            "--use-distributed-optimizer and --overlap-grad-reduce (Megatron-LM's rule)"
        ),
    ),
    (
        lambda a, t: a.grad_reduce_in_bf16 and not a.bf16,
        lambda a, t: "--grad-reduce-in-bf16 reduces bf16 gradients: it needs --bf16",
    ),
    (
        lambda a, t: a.num_layers_per_virtual_pipeline_stage is not None and _virtual_problem(a, t),
        lambda a, t: (
            f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage}: "
            + _virtual_problem(a, t)
        ),
    ),
    (
        lambda a, t: a.use_megatron_fsdp,
        lambda a, t: (
            "--use-megatron-fsdp: this trainer shards weights with torch FSDP2 (--use-torch-fsdp2) or, with "
            "--use-distributed-optimizer, gradients and Adam's state over the data-parallel x Ulysses ranks; "
            "Megatron-FSDP runs in Megatron-LM's pretrain_gpt.py through megatron_patches (GPU)"
        ),
    ),
    (
        lambda a, t: a.use_torch_fsdp2 and _fsdp2_conflict(a),
        lambda a, t: f"--use-torch-fsdp2 with {_fsdp2_conflict(a)}",
    ),
    (
        lambda a, t: a.use_torch_fsdp2 and _megatron_core() < (0, 17),
        lambda a, t: (
            "--use-torch-fsdp2: megatron-core 0.16's torch-FSDP2 wrapper fails with or without Ulysses (its "
            "finish_grad_sync takes no force_all_reduce, which its own finalize_model_grads passes): "
            "use megatron-core 0.17 or newer, or --use-distributed-optimizer"
        ),
    ),
    (
        lambda a, t: a.num_experts and a.num_experts % a.expert_model_parallel_size,
        lambda a, t: (
            f"--num-experts {a.num_experts} must be divisible by --expert-model-parallel-size "
            f"{a.expert_model_parallel_size}"
        ),
    ),
    (
        lambda a, t: a.expert_model_parallel_size > 1 and not a.num_experts,
        lambda a, t: f"--expert-model-parallel-size {a.expert_model_parallel_size} splits experts: add --num-experts",
    ),
    (
        lambda a, t: a.num_experts and _cpu(a),
        lambda a, t: (
            f"--num-experts {a.num_experts}: Megatron-Core's MoE layer needs a GPU (on CPU its token dispatchers "
            "fail inside Megatron with or without Ulysses: an in-place write to an all-gather's output, CUDA "
            "events); drop --num-experts on CPU"
        ),
    ),
    (
        lambda a, t: a.optimizer_cpu_offload and not a.use_distributed_optimizer,
        lambda a, t: "--optimizer-cpu-offload needs --use-distributed-optimizer (Megatron's rule)",
    ),
    (
        lambda a, t: a.optimizer_cpu_offload and _cpu(a),
        lambda a, t: (
            "--optimizer-cpu-offload moves Adam's state from the GPU to the host: on CPU it already is there "
            "(and Megatron's hybrid-device optimizer refuses CPU weights); drop the flag on CPU"
        ),
    ),
    (
        lambda a, t: a.offload_modules and not a.fine_grained_activation_offloading,
        lambda a, t: "--offload-modules names what --fine-grained-activation-offloading offloads: add that flag",
    ),
    (
        lambda a, t: a.fine_grained_activation_offloading and _cpu(a),
        lambda a, t: (
            "--fine-grained-activation-offloading copies activations to host memory on CUDA streams with "
            "Transformer Engine's CPU offload: it needs a GPU with Transformer Engine; drop the flag on CPU"
        ),
    ),
)

# (the flags break this rule, the message naming them and the fix): checked in order, the first raises
_CONSISTENCY = (
    (
        lambda a, t: a.dynamic_ulysses and not a.reset_attention_mask,
        lambda a, t: (
            "--dynamic-ulysses places documents: it needs --reset-attention-mask (documents split at EOD, "
            "each attending only to itself)"
        ),
    ),
    (
        lambda a, t: a.dynamic_ulysses and (a.pipeline_model_parallel_size > 1 or a.context_parallel_size > 1),
        lambda a, t: (
            f"--dynamic-ulysses runs with --pipeline-model-parallel-size 1 and --context-parallel-size 1, "
            f"not {a.pipeline_model_parallel_size} and {a.context_parallel_size}: a slot's group changes per "
            "micro-batch, which Megatron's pipeline schedules and the ring's fixed group do not take; "
            "drop --dynamic-ulysses for these layouts"
        ),
    ),
    (
        lambda a, t: a.dynamic_ulysses and (a.ulysses_degree & (a.ulysses_degree - 1)),
        lambda a, t: (
            f"--dynamic-ulysses needs --ulysses-degree a power of two (its groups halve), not {a.ulysses_degree}"
        ),
    ),
    (
        lambda a, t: (
            a.dynamic_ulysses
            and (
                a.attention_backend == "te"
                or a.attention_backend == "auto"
                and a.transformer_impl == "transformer_engine"
            )
        ),
        lambda a, t: (
            "--dynamic-ulysses runs --attention-backend sdpa or flash: Transformer Engine's attention is a "
            "child module built for one degree (pass --attention-backend sdpa or flash)"
        ),
    ),
    (
        lambda a, t: a.dynamic_ulysses and (a.micro_batch_size * a.seq_length) % a.ulysses_degree,
        lambda a, t: (
            f"--dynamic-ulysses: --micro-batch-size {a.micro_batch_size} x --seq-length {a.seq_length} must be "
            f"divisible by --ulysses-degree {a.ulysses_degree} (the per-rank load of a slot)"
        ),
    ),
    (
        lambda a, t: (
            a.dynamic_ulysses
            and a.sequence_parallel
            and (a.micro_batch_size * a.seq_length // a.ulysses_degree) % a.tensor_model_parallel_size
        ),
        lambda a, t: (
            f"--dynamic-ulysses with --sequence-parallel: the per-rank load --micro-batch-size x --seq-length / "
            f"--ulysses-degree = {a.micro_batch_size * a.seq_length // a.ulysses_degree} must be divisible by "
            f"--tensor-model-parallel-size {a.tensor_model_parallel_size}"
        ),
    ),
    (
        lambda a, t: a.calibration is not None and calibration_problem(a.calibration),
        lambda a, t: f"--calibration {a.calibration}: {calibration_problem(a.calibration)}",
    ),
    (
        lambda a, t: a.dynamic_bucket is not None and a.dynamic_bucket < 1,
        lambda a, t: f"--dynamic-bucket must be a positive number of tokens, got {a.dynamic_bucket}",
    ),
    (
        lambda a, t: a.context_parallel_size > 1 and a.attention_backend == "flash",
        lambda a, t: (
            "--context-parallel-size > 1 runs the ring with --attention-backend sdpa (log-sum-exp ring) or "
            "te (Transformer Engine's p2p ring), not flash"
        ),
    ),
    (
        lambda a, t: a.context_parallel_size > 1 and a.attention_backend == "te" and a.reset_attention_mask,
        lambda a, t: (
            "--reset-attention-mask with --context-parallel-size > 1 needs --attention-backend sdpa "
            "(Transformer Engine's ring takes unpacked causal input only)"
        ),
    ),
    (
        lambda a, t: a.num_layers % a.pipeline_model_parallel_size,
        lambda a, t: (
            f"--num-layers {a.num_layers} must be divisible by --pipeline-model-parallel-size "
            f"{a.pipeline_model_parallel_size}"
        ),
    ),
    (
        lambda a, t: a.kv_channels is None and a.hidden_size % a.num_attention_heads,
        lambda a, t: (
            f"--hidden-size {a.hidden_size} must be divisible by --num-attention-heads {a.num_attention_heads} "
            "(or give each head's channels with --kv-channels)"
        ),
    ),
    (
        lambda a, t: a.global_batch_size % (a.micro_batch_size * t.dp),
        lambda a, t: (
            f"--global-batch-size {a.global_batch_size} must be a multiple of --micro-batch-size "
            f"{a.micro_batch_size} x data-parallel size {t.dp} (world {t.world_size} / (tp x ulysses x cp x pp))"
        ),
    ),
    (
        lambda a, t: (
            a.position_embedding_type == "learned_absolute"
            and (a.max_position_embeddings or a.seq_length) < a.seq_length
        ),
        lambda a, t: (
            f"--max-position-embeddings {a.max_position_embeddings} is below --seq-length {a.seq_length}: "
            "learned absolute positions need one embedding per position; raise it to at least "
            f"{a.seq_length}"
        ),
    ),
    (
        lambda a, t: a.vocab_size is not None and a.vocab_size < _TOKENIZER_IDS,
        lambda a, t: (
            f"--vocab-size {a.vocab_size} is below the byte tokenizer's {_TOKENIZER_IDS} ids: the embedding needs "
            f"a row for every id; pass at least {_TOKENIZER_IDS}, or leave it out"
        ),
    ),
    (
        lambda a, t: padded_vocab(a) % a.tensor_model_parallel_size,
        lambda a, t: (
            f"padded vocab {padded_vocab(a)} is not divisible by --tensor-model-parallel-size "
            f"{a.tensor_model_parallel_size}: raise --make-vocab-size-divisible-by to a multiple of it"
        ),
    ),
    (
        lambda a, t: a.min_lr > a.lr,
        lambda a, t: (
            f"--min-lr {a.min_lr} is above --lr {a.lr}: the schedule decays from --lr down to --min-lr "
            "(default 3e-4 here, 0 in Megatron-LM); pass a lower --min-lr"
        ),
    ),
    (
        lambda a, t: a.transformer_impl == "transformer_engine" and not torch.cuda.is_available(),
        lambda a, t: (
            "--transformer-impl transformer_engine needs a CUDA GPU with Transformer Engine; "
            "use --transformer-impl local on CPU"
        ),
    ),
    (lambda a, t: a.save_interval is not None and not a.save, lambda a, t: "--save-interval needs --save DIR"),
    (lambda a, t: a.load and not os.path.isdir(a.load), lambda a, t: f"--load {a.load} is not a directory"),
    (
        lambda a, t: a.override_opt_param_scheduler and a.use_checkpoint_opt_param_scheduler,
        lambda a, t: (
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other: "
            "give one (the command line's schedule, or the checkpoint's)"
        ),
    ),
    (
        lambda a, t: a.sequence_parallel and a.tensor_model_parallel_size == 1,
        lambda a, t: "--sequence-parallel needs --tensor-model-parallel-size > 1",
    ),
    (
        lambda a, t: a.sequence_parallel and not torch.cuda.is_available(),
        lambda a, t: "--sequence-parallel needs Transformer Engine or apex norms (GPU); on CPU drop the flag",
    ),
    (
        lambda a, t: a.attention_backend in ("flash", "te") and not torch.cuda.is_available(),
        lambda a, t: f"--attention-backend {a.attention_backend} needs a CUDA GPU; use sdpa on CPU",
    ),
    *_MEMORY_RULES,
    (
        lambda a, t: a.lr_warmup_iters >= a.train_iters and a.train_iters > 1,
        lambda a, t: (
            f"--lr-warmup-iters {a.lr_warmup_iters} must be < --train-iters {a.train_iters}: "
            f"pass --lr-warmup-iters {a.train_iters - 1} or fewer (0: no warm-up), or more --train-iters"
        ),
    ),
)


def calibration_problem(path: str):
    """What is wrong with a calibration file for the dynamic placement, or None."""
    try:
        Calibration.load(path)
    except CalibrationError as e:
        return str(e).removeprefix(f"--calibration {path}: ")
    return None


def layout_problem(flags, world_size: int) -> str:
    """Why the trainer refuses these flags at this world size ("" when it accepts them)."""
    try:
        validate(build_parser().parse_args(flags), world_size)
    except ValueError as e:
        return str(e)
    return ""


def validate(args, world_size: int):
    """Every check that needs no collective; raises ValueError naming the flag and the fix.
    Ranges first (a 0 must not reach a modulo), then the layout, then the flags against each other."""
    if args.group_query_attention and args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default for --num-query-groups
    check_ranges(args)
    topo = Topology(
        world_size,
        tp=args.tensor_model_parallel_size,
        ulysses=args.ulysses_degree,
        cp=args.context_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
    )
    topo.check_model(args.num_attention_heads, args.num_query_groups, args.seq_length)
    for broken, message in _CONSISTENCY:
        if broken(args, topo):
            raise ValueError(message(args, topo))
    return topo


_TOKENIZER_IDS = 258  # the byte tokenizer's ids (data.ByteTokenizer: 256 bytes, end of document, padding)


def padded_vocab(args) -> int:
    """--vocab-size (default: the byte tokenizer's ids) padded to a multiple of
    --make-vocab-size-divisible-by (not x tp, unlike Megatron-LM, so that checkpoints reshard across tp)."""
    m = args.make_vocab_size_divisible_by
    return int(math.ceil((getattr(args, "vocab_size", None) or _TOKENIZER_IDS) / m) * m)


def metrics_dir(args) -> str:
    """Where metrics.csv goes: --log-dir, else --save, else runs/."""
    return args.log_dir or args.save or "runs"


def corpus_dir(args) -> str:
    """Where the embedded corpus' indexed dataset is written without --data-path."""
    return os.path.join(args.log_dir or "runs", "data")


def output_dirs(args):
    """(flag, directory) for every directory this run writes: checkpoints (every rank writes
    its shards), metrics and the embedded corpus' dataset."""
    out = []
    if args.save:
        out.append(("--save", args.save))
    out.append(
        ("--log-dir" if args.log_dir else ("--save" if args.save else "--log-dir (default runs/)"), metrics_dir(args))
    )
    if args.data_path is None:
        out.append(("--log-dir" if args.log_dir else "--log-dir (default runs/)", corpus_dir(args)))
    return out


def check_output_dirs(args, rank: int) -> None:
    """Create and write-test every output directory now, on this rank (every rank runs it on
    the same paths, so every rank gets the same answer), not at the first save."""
    seen = set()
    for name, d in output_dirs(args):
        if d in seen:
            continue
        seen.add(d)
        probe = os.path.join(d, f".write_test.rank{rank}.{os.getpid()}")
        try:
            os.makedirs(d, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            why = e.strerror or type(e).__name__
            if isinstance(e, (FileExistsError, NotADirectoryError)):
                why = f"{_first_file(d)} is a file, not a directory"
            raise ValueError(f"{name} {d}: cannot write there ({why}); give a writable directory") from None


def _first_file(d: str) -> str:
    """The first existing non-directory on the way to ``d``."""
    path = os.path.abspath(d)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        p = os.sep.join(parts[:i])
        if os.path.exists(p) and not os.path.isdir(p):
            return p
    return d
