r"""The trainer: pretrain a GPT with Megatron-Core and Ulysses sequence parallelism.

    torchrun --nproc-per-node 4 --no-python ulysses-mcore pretrain \
        --tensor-model-parallel-size 2 --ulysses-degree 2 --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 30 --lr 3e-3

Megatron-LM's flag names and meanings.  NCCL on GPUs, gloo on CPU, chosen automatically.
Without --data-path it trains on the embedded corpus (package data, byte-level tokens).
``examples/pretrain_gpt.py`` and ``python -m ulysses_mcore.megatron.trainer.pretrain`` both run
:func:`main`.  The loop
is Megatron-Core's: GPTModel from a Ulysses layer spec, DistributedDataParallel,
get_megatron_optimizer + OptimizerParamScheduler, get_forward_backward_func (pipeline
schedules), GPTDataset via BlendedMegatronDatasetBuilder, dist_checkpointing.
Checkpoints do not depend on the Ulysses degree (or TP/PP): resume with other degrees.
"""

from __future__ import annotations

import csv
import functools
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ulysses_mcore.megatron.trainer.parser import build_parser
from ulysses_mcore.megatron.trainer.arguments import (
    check_output_dirs,
    corpus_dir,
    metrics_dir,
    padded_vocab,
    validate,
)
from ulysses_mcore.megatron.trainer.errors import is_collective_failure
from ulysses_mcore.megatron.trainer.checkpoint import save_checkpoint, schedule_from_flags
from ulysses_mcore.megatron.trainer.resume import inspect_checkpoint, load_checkpoint, trim_metrics


# ------------------------------------------------------------------------ main
def main(argv=None):
    run = RunState()
    args = build_parser(__doc__).parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        topo = validate(args, world_size)
        check_output_dirs(args, int(os.environ.get("RANK", "0")))
    except ValueError as e:  # every rank runs the same checks: every rank exits here, no collective yet
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.exit_signal_handler:  # Megatron-LM's: note SIGTERM, act on it at the end of the iteration
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(run, "signalled", True))

    from ulysses_mcore import lifetime
    from ulysses_mcore.megatron.compat import cpu_compat

    lifetime.children_die_with_this_process()  # a killed rank takes what it forked with it

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu_compat.apply()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or "1")))
    if "RANK" not in os.environ:  # plain `python examples/pretrain_gpt.py`: a world of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533")
        )
    from datetime import timedelta

    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=args.distributed_timeout_minutes))
    try:
        return train(args, topo, use_cuda, run)
    except (ValueError, FileNotFoundError) as e:  # raised alike on every rank (data, checkpoint checks)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as e:  # NaN/Inf with --on-nan stop: every rank raises it at the same iteration
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except Exception as e:  # noqa: BLE001 - reported as what it is, on this rank
        rank, it = dist.get_rank(), run.iteration + 1
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        if is_collective_failure(e):
            print(
                f"error: rank {rank}: a collective failed at iteration {it} -- a peer rank died or stopped "
                f"responding within --distributed-timeout-minutes {args.distributed_timeout_minutes} "
                f"({type(e).__name__}: {first}). Check the other ranks' logs.",
                file=sys.stderr,
                flush=True,
            )
            return 4
        import traceback

        traceback.print_exc()
        print(
            f"error: rank {rank}: {type(e).__name__} at iteration {it}: {first} (a local error on this rank; "
            f"the traceback above says where)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        _release(run)


def _release(run) -> None:
    """Every group this run made (--dynamic-ulysses' own, Megatron's), then the process group."""
    from ulysses_mcore.megatron.layer import groups

    if run.groups is not None:
        run.groups.destroy()
    groups.destroy()
    dist.destroy_process_group()


class RunState:
    """One run's state: when it started, whether SIGTERM came, the iteration reached (for the
    error message of a failure), and the parts the steps below build and advance."""

    def __init__(self):
        self.started = time.time()
        self.groups = None  # --dynamic-ulysses: every degree's groups (megatron.dynamic.DynamicGroups)
        self.signalled = False
        self.iteration = 0
        self.consumed = 0


def train(args, topo, use_cuda, run: RunState):
    """Megatron-LM's pretraining loop in named steps: start-up, data, model, resume, then
    iterations (train step, log, evaluate, save, exit checks)."""
    run.groups = _initialize(args, topo)
    if args.load:  # every check of the checkpoint before any work: the same error on every rank
        checkpoint = inspect_checkpoint(args)
    data = _Data(args, run.groups)
    model, optimizer, scheduler = _build_model(args)
    if args.load:
        _resume(args, run, checkpoint, model, optimizer, scheduler)
    log = _Metrics(args, run.iteration) if _is_logging_rank() else None
    timer = _Timing(args, model, optimizer, run.groups) if args.timing else None
    data.announce(run.consumed)
    reason = None
    save = functools.partial(
        save_checkpoint, args.save, model=model, optimizer=optimizer, scheduler=scheduler, args=args
    )
    saved = True  # nothing trained since the checkpoint (or the start) yet
    while run.iteration < args.train_iters:
        _iteration(args, run, data, model, optimizer, scheduler, log, use_cuda)
        if timer:
            timer.record(run.iteration)
        saved = bool(args.save and args.save_interval and run.iteration % args.save_interval == 0)
        if saved:
            save(iteration=run.iteration, consumed_samples=run.consumed)
        reason = _exit_reason(args, run)
        if reason:
            break
    if args.save and not saved:  # the last iteration, or an exit (nothing is saved again when nothing was trained)
        save(iteration=run.iteration, consumed_samples=run.consumed)
    if reason and dist.get_rank() == 0:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] exiting program {reason}", flush=True)
    return 0


def _is_logging_rank() -> bool:
    """The first rank of the last pipeline stage (where the loss is)."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def _initialize(args, topo):
    """Megatron's groups (and with --dynamic-ulysses every degree's groups, returned; else None)."""
    import ulysses_mcore
    from megatron.core import tensor_parallel

    dynamic = args.dynamic_ulysses  # Megatron sees the data-parallel x Ulysses ranks as its data-parallel axis
    ulysses_mcore.initialize(
        tp=topo.tp,
        ulysses=1 if dynamic else topo.ulysses,
        cp=topo.cp,
        pp=topo.pp,
        distributed_timeout_minutes=max(1, int(math.ceil(args.distributed_timeout_minutes))),
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        seq_length=args.seq_length,
    )
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    if dynamic:
        from ulysses_mcore.megatron.trainer.dynamic import DynamicGroups

        groups = DynamicGroups(topo.world_size, topo.tp, topo.ulysses)
        if dist.get_rank() == 0:
            print(
                f"[ulysses-mcore] --dynamic-ulysses: a degree per document from 1 to {topo.ulysses} over the "
                f"{topo.world_size // topo.tp} data-parallel x Ulysses ranks of each tensor-parallel rank "
                f"(Megatron's data-parallel size {topo.world_size // topo.tp}, context-parallel size 1)",
                flush=True,
            )
        return groups
    return None


class _Data:
    """Megatron's GPTDataset over the corpus, global-batch samplers, and the sharding of a batch."""

    def __init__(self, args, groups=None):
        from megatron.core import parallel_state as ps

        from ulysses_mcore.megatron.trainer import data as D

        self.args, self.tok = args, D.ByteTokenizer()
        G = args.global_batch_size
        n_eval = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else 0
        build = functools.partial(
            D.build_gpt_datasets,
            seq_length=args.seq_length,
            seed=args.seed,
            split=args.split,
            samples=[args.train_iters * G, n_eval * G, 0],
            tokenizer=self.tok,
        )
        prefix = args.data_path or _embedded_corpus(D, args, self.tok, build)
        train_ds, valid_ds, _ = build(prefix)
        kw = dict(  # --dynamic-ulysses: every rank reads the whole global batch (and places it)
            global_batch_size=G,
            micro_batch_size=args.micro_batch_size,
            dp_size=1 if args.dynamic_ulysses else ps.get_data_parallel_world_size(),
            dp_rank=0 if args.dynamic_ulysses else ps.get_data_parallel_rank(),
        )
        self.sampler = D.GlobalBatchSampler(train_ds, **kw)
        self.vsampler = D.GlobalBatchSampler(valid_ds, **kw) if valid_ds is not None and n_eval else None
        # a packed micro-batch is one stream of micro-batch-size x seq-length tokens
        seq, mbs = args.seq_length, args.micro_batch_size
        self.sched = (
            dict(seq_length=seq * mbs, micro_batch_size=1)
            if args.reset_attention_mask
            else dict(seq_length=seq, micro_batch_size=mbs)
        )
        self.dynamic = _dynamic_batches(args, self.tok, groups) if groups is not None else None

    def shard(self, mbs):
        from ulysses_mcore.megatron.layer.batch import pack_batch, reset_position_ids, shard_batch

        args = self.args
        if self.dynamic is not None:  # the global batch placed document by document (docs/dynamic.md)
            return self.dynamic.microbatches(mbs)
        if args.reset_attention_mask:  # one packed THD stream per micro-batch, documents split at EOD
            packed = [pack_batch(mb, self.tok.eod, reset_positions=args.reset_position_ids) for mb in mbs]
            _agree_on_boundaries(packed)
            return [shard_batch(mb) for mb in packed]
        if args.reset_position_ids:
            mbs = [reset_position_ids(mb, self.tok.eod) for mb in mbs]
        return [shard_batch(mb, load_balanced=True) for mb in mbs]

    def announce(self, consumed):
        from ulysses_mcore.megatron.layer.batch import document_boundaries

        args = self.args
        if args.reset_attention_mask and dist.get_rank() == 0:
            first = self.sampler.microbatches(consumed)
            n_docs = sum(len(document_boundaries(mb["tokens"], self.tok.eod)) - 1 for mb in first)
            print(
                f"[ulysses-mcore] --reset-attention-mask: each micro-batch is one packed THD stream of "
                f"{args.micro_batch_size} x {args.seq_length} tokens split at EOD (cu_seqlens, no [s, s] mask); "
                f"{n_docs} documents in rank 0's first {len(first)} micro-batches",
                flush=True,
            )


def _agree_on_boundaries(packed) -> None:
    """Once a step, the ranks that share a sequence (Megatron's context-parallel group: Ulysses x ring)
    agree on the document boundaries of its packed micro-batches (host tensors here: one all-reduce,
    no device read), so ranks that read different data stop with the same error instead of running
    attention over boundaries that differ (which no later call checks)."""
    from megatron.core import parallel_state as ps

    from ulysses_mcore.agreement import agree, digest

    group = ps.get_context_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    bounds = tuple(tuple(mb["cu_seqlens"].tolist()) for mb in packed)  # host tensors: no sync
    if not agree(digest(bounds), group):
        raise ValueError(
            "--reset-attention-mask: the ranks sharing a sequence (Ulysses x ring) read different documents "
            "(their packed boundaries differ); every rank must read the same data (the same --data-path, "
            "--split and --seed)"
        )


def _dynamic_batches(args, tok, groups):
    from ulysses_mcore.megatron.trainer.dynamic import DynamicBatches, bucket_of, costs_of

    cap = args.micro_batch_size * args.seq_length // args.ulysses_degree
    return DynamicBatches(
        groups,
        cap=cap,
        costs=costs_of(args),
        bucket=bucket_of(args, cap),
        eod=tok.eod,
        reset_positions=args.reset_position_ids,
    )


def _embedded_corpus(D, args, tok, build) -> str:
    """The embedded corpus' indexed dataset and Megatron's index caches, made by each node's first
    rank in its own --log-dir (nodes need not share a folder); returns its prefix."""
    prefix = os.path.join(corpus_dir(args), "kjv")
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        if not os.path.exists(prefix + ".idx"):
            _index_embedded_corpus(D, prefix, tok)
        if dist.get_rank() != 0:  # global rank 0 builds its caches inside the builder's own collective call
            with D.as_one_process():
                build(prefix)
    dist.barrier()
    return prefix


def _index_embedded_corpus(D, prefix: str, tok) -> None:
    """The embedded corpus as an indexed dataset at ``prefix``, written under a name of this process's
    and renamed into place (.bin, then .idx): node leaders sharing a folder never see half a file."""
    import socket

    tmp = f"{prefix}.tmp-{socket.gethostname()}-{os.getpid()}"
    D.write_indexed_dataset(D.read_documents(D.EMBEDDED_CORPUS), tmp, tok, progress=False)
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")


def _build_model(args):
    """(DDP GPTModel, Megatron optimizer, Megatron LR scheduler) of the flags; the same initial
    model for every tp / pp / ulysses / cp / dp layout (one --seed)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ulysses_mcore.megatron.trainer import training

    model, cfg = build_model(args)
    training.init_layout_independent(model, cfg, args.seed)
    optimizer = training.build_optimizer(
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
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        **schedule_from_flags(args),  # the values a checkpoint's schedule is checked against
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
    )
    return model, optimizer, scheduler


def build_model(args, *, vocab_size=None, wrap_ddp: bool = True, **config):
    """(GPTModel of the flags, in Megatron's DDP unless ``wrap_ddp=False``; its TransformerConfig):
    the trainer's model, also the dry run's (``vocab_size``: another vocabulary than the byte
    tokenizer's; ``config``: TransformerConfig keywords over the flags')."""
    from ulysses_mcore.megatron.trainer import training
    from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec

    te = args.transformer_impl == "transformer_engine"
    backend = args.attention_backend if args.attention_backend != "auto" else ("te" if te else "sdpa")
    cfg = training.gpt_config(**(_config_of(args) | config))
    dynamic = None
    if args.dynamic_ulysses:  # RoPE moves into the attention, after the exchange (docs/dynamic.md)
        from ulysses_mcore.megatron.layer.rotary import DynamicOptions

        dynamic = DynamicOptions(args.ulysses_degree, rope=args.position_embedding_type == "rope")
    model = training.build_gpt(
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
        ),
        wrap_ddp=wrap_ddp,
    )
    if args.loss_chunk_tokens:
        from ulysses_mcore.megatron.layer.memory import enable_chunked_loss

        enable_chunked_loss(model.module if wrap_ddp else model, args.loss_chunk_tokens)
    return model, cfg


def _config_of(args) -> dict:
    """Megatron TransformerConfig keywords of the flags."""
    full = args.recompute_granularity == "full"
    ffn = args.ffn_hidden_size or (
        int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
    )
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
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
        recompute_granularity=args.recompute_granularity,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
    )


def _resume(args, run, checkpoint, model, optimizer, scheduler):
    ckpt, extra, note = checkpoint
    rank, t_load = dist.get_rank(), time.time()
    if rank == 0:
        print(f"loading checkpoint from {args.load} at iteration {extra['iteration']}{note}", flush=True)
    run.iteration, run.consumed = load_checkpoint(ckpt, extra, model, optimizer, scheduler)
    if rank == 0:
        print(
            f"  successfully loaded checkpoint from {args.load} at iteration {run.iteration} "
            f"({time.time() - t_load:.2f} s)",
            flush=True,
        )
        print(
            f"[ulysses-mcore] resumed from {args.load} at iteration {run.iteration} ({run.consumed} samples consumed)",
            flush=True,
        )


class _Metrics:
    """metrics.csv of the logging rank: one row per logged iteration (a resumed run drops the rows
    after its checkpoint: those iterations are trained again)."""

    COLUMNS = [
        "iteration",
        "consumed_samples",
        "lm_loss",
        "lr",
        "grad_norm",
        "ms_per_iter",
        "tokens_per_second",
        "peak_memory_gb",
        "kind",
    ]

    def __init__(self, args, iteration):
        log_dir = metrics_dir(args)
        os.makedirs(log_dir, exist_ok=True)
        metrics = os.path.join(log_dir, "metrics.csv")
        fresh = not os.path.exists(metrics) or not args.load
        if not fresh:
            dropped = trim_metrics(metrics, iteration)
            if dropped:
                print(
                    f"[ulysses-mcore] {metrics}: dropped {dropped} rows after iteration {iteration} "
                    "(they are trained again)",
                    flush=True,
                )
        self.fh = open(metrics, "w" if fresh else "a", newline="")
        self.writer = csv.writer(self.fh)
        if fresh:
            self.writer.writerow(self.COLUMNS)

    def row(self, *values):
        self.writer.writerow(values)
        self.fh.flush()


class _Timing:
    """``--timing``: each iteration's phase times and bytes sent (:mod:`.timing`), one JSON line per
    iteration in ``timing_rank<R>.jsonl`` beside metrics.csv, on every rank."""

    def __init__(self, args, model, optimizer, groups=None):
        import json

        from ulysses_mcore.megatron.layer import groups as built
        from ulysses_mcore.megatron.trainer.timing import StepTimer

        a2a = built.get_ulysses_group()
        if groups is not None:  # --dynamic-ulysses: every degree's groups this rank is in
            a2a = groups.mine()
        self.timer = StepTimer(a2a, built.get_ring_group()).install(model, optimizer)
        os.makedirs(metrics_dir(args), exist_ok=True)
        path = os.path.join(metrics_dir(args), f"timing_rank{dist.get_rank()}.jsonl")
        self.fh = open(path, "a" if args.load else "w")  # a resumed run continues the file
        self.dumps = json.dumps

    def record(self, iteration):
        self.fh.write(self.dumps({"iteration": iteration, **self.timer.take()}) + "\n")
        self.fh.flush()


def _iteration(args, run, data, model, optimizer, scheduler, log, use_cuda):
    """One training iteration, its log line and row, and the evaluation when it is due."""
    from ulysses_mcore.megatron.trainer import training

    G, t0 = args.global_batch_size, time.perf_counter()
    mbs = data.shard(data.sampler.microbatches(run.consumed))
    lr = optimizer.param_groups[0]["lr"]
    m = training.train_step(
        model,
        optimizer,
        mbs,
        scheduler=scheduler,
        increment=G,
        iteration=run.iteration + 1,
        on_nonfinite=args.on_nan,
        **data.sched,
    )
    run.iteration += 1
    run.consumed += G
    dt = time.perf_counter() - t0
    if m["skipped"] and log:
        print(f"[ulysses-mcore] {m['message']}: update skipped (--on-nan skip)", flush=True)
    if log and run.iteration % args.log_interval == 0:
        from ulysses_mcore.megatron.trainer.timing import peak_gb

        peak = peak_gb()
        tps = G * args.seq_length / dt
        print(
            f" iteration {run.iteration:8d}/{args.train_iters:8d} | consumed samples: {run.consumed:12d} | "
            f"elapsed time per iteration (ms): {dt * 1e3:.1f} | learning rate: {lr:.6E} | "
            f"global batch size: {G:5d} | lm loss: {m['loss']:.6E} | grad norm: {m['grad_norm']:.3f} | "
            f"tokens per second: {tps:.0f} | peak memory (GB): {peak:.2f} |",
            flush=True,
        )
        if data.dynamic is not None:
            _log_schedule(data.dynamic.last, dt)
        log.row(
            run.iteration,
            run.consumed,
            f"{m['loss']:.8e}",
            f"{lr:.6e}",
            f"{m['grad_norm']:.6f}",
            f"{dt * 1e3:.2f}",
            f"{tps:.1f}",
            f"{peak:.3f}",
            "train",
        )
    if data.vsampler is not None and args.eval_interval and run.iteration % args.eval_interval == 0:
        _evaluate(args, run, data, model, log)


def _log_schedule(last: dict, step_seconds: float) -> None:
    share = last["exchanged_tokens"] / max(1, last["tokens"])
    busy, sched = last["predicted_busy_max_over_mean"], last["scheduler_seconds"]
    print(
        f"   dynamic: {last['slots']} slots | documents by degree {last['documents']} | all-to-all tokens "
        f"{share:.2f} of the fixed degree's | predicted busiest / mean rank {busy:.3f} | "
        f"scheduler {sched * 1e3:.1f} ms ({100 * sched / step_seconds:.2f}% of the step) |",
        flush=True,
    )


def _evaluate(args, run, data, model, log):
    from ulysses_mcore.megatron.trainer import training

    G = args.global_batch_size
    losses = [
        training.evaluate(model, data.shard(data.vsampler.microbatches(i * G)), **data.sched)
        for i in range(args.eval_iters)
    ]
    if log:
        val = sum(losses) / len(losses)
        print(
            f" validation loss at iteration {run.iteration} | lm loss value: {val:.6E} | "
            f"lm loss PPL: {math.exp(min(val, 50)):.6E} |",
            flush=True,
        )
        log.row(run.iteration, run.consumed, f"{val:.8e}", "", "", "", "", "", "valid")


def _exit_reason(args, run: RunState):
    """Megatron-LM's exits, agreed by every rank: SIGTERM seen by any rank (--exit-signal-handler),
    time up on any rank (--exit-duration-in-mins): one all-reduce per iteration, only with those
    flags; --exit-interval needs none."""
    iteration = run.iteration
    if args.exit_signal_handler or args.exit_duration_in_mins:
        minutes = (time.time() - run.started) / 60.0
        flags = torch.tensor(
            [float(run.signalled), float(bool(args.exit_duration_in_mins) and minutes > args.exit_duration_in_mins)]
        )
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flags = flags.to(dev)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, timed_out = flags.tolist()
        if signalled:
            return "after receiving SIGTERM."
        if timed_out:
            return f"after {minutes:.2f} minutes (--exit-duration-in-mins {args.exit_duration_in_mins:g})"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"at iteration {iteration} (--exit-interval {args.exit_interval})"
    return None


if __name__ == "__main__":
    sys.exit(main())
