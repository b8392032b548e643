"""The training loop: Megatron-LM's pretraining loop in named steps -- start-up (Megatron's groups,
and every degree's with --dynamic-ulysses), data, model, resume, then iterations (train step, log,
evaluate, save, exit checks).  :func:`ulysses_mcore.megatron.trainer.pretrain.main` checks the flags
first and runs :func:`train`."""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

import ulysses_mcore
from ulysses_mcore.megatron.layer import groups as built
from ulysses_mcore.megatron.trainer import training
from ulysses_mcore.megatron.trainer.checkpoint import save_checkpoint
from ulysses_mcore.megatron.trainer.dynamic import DynamicGroups
from ulysses_mcore.megatron.trainer.feed import DataFeed
from ulysses_mcore.megatron.trainer.logs import MetricsLog, TimingLog
from ulysses_mcore.megatron.trainer.model import build_trainable, virtual_stages
from ulysses_mcore.megatron.trainer.resume import inspect_checkpoint, load_checkpoint
from ulysses_mcore.megatron.trainer.timing import peak_gb


def release(run) -> None:
    """Every group this run made (--dynamic-ulysses' own, Megatron's), then the process group."""
    if run.groups is not None:
        run.groups.destroy()
    built.destroy()
    dist.destroy_process_group()


def train(args, topo, run):
    """Megatron-LM's pretraining loop in named steps: start-up, data, model, resume, then
    iterations (train step, log, evaluate, save, exit checks); ``run``: the entry's
    :class:`~ulysses_mcore.megatron.trainer.pretrain.RunState`, advanced here."""
    run.groups = _initialize(args, topo)
    if args.load:  # every check of the checkpoint before any work: the same error on every rank
        checkpoint = inspect_checkpoint(args)
    data = DataFeed(args, run.groups)
    parts = build_trainable(args)
    model, optimizer = parts.model, parts.optimizer
    if args.load:
        _resume(args, run, checkpoint, parts)
    log = MetricsLog(args, run.iteration) if _is_logging_rank() else None
    timer = TimingLog(args, model, optimizer, run.groups) if args.timing else None
    data.announce(run.consumed)
    reason = None
    save = functools.partial(_save, args, parts)
    saved = True  # nothing trained since the checkpoint (or the start) yet
    while run.iteration < args.train_iters:
        _iteration(args, run, data, parts, log)
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
    _report_offload(model)
    if reason and dist.get_rank() == 0:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] exiting program {reason}", flush=True)
    return 0


def _report_offload(model) -> None:
    """--offload-activation-checkpoints: what went to host memory over the run (rank 0's)."""
    stats = getattr(training.chunked(model)[0].module, "_offload_stats", None)  # the chunks share one
    if stats is not None and dist.get_rank() == 0:
        print(
            f"[ulysses-mcore] activation checkpoints in host memory: {stats['tensors']} tensors moved, peak "
            f"{stats['peak_host_bytes'] / 1e9:.3g} GB per rank",
            flush=True,
        )


def _save(args, parts, **state) -> None:
    training.sync_params(parts.model)  # --overlap-param-gather: the updated weights, not the previous step's
    save_checkpoint(args.save, **parts._asdict(), args=args, **state)


def _is_logging_rank() -> bool:
    """The first rank of the last pipeline stage (where the loss is)."""
    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def _initialize(args, topo):
    """Megatron's groups (and with --dynamic-ulysses every degree's groups, returned; else None)."""
    dynamic = args.dynamic_ulysses  # Megatron sees the data-parallel x Ulysses ranks as its data-parallel axis
    ulysses_mcore.initialize(
        tp=topo.tp,
        ulysses=1 if dynamic else topo.ulysses,
        cp=topo.cp,
        pp=topo.pp,
        ep=topo.ep,
        virtual_pipeline_model_parallel_size=virtual_stages(args),
        distributed_timeout_minutes=max(1, int(math.ceil(args.distributed_timeout_minutes))),
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        seq_length=args.seq_length,
    )
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    if dynamic:
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


def _resume(args, run, checkpoint, parts):
    """``parts``: the (model, optimizer, scheduler) the checkpoint is loaded into."""
    ckpt, extra, note = checkpoint
    rank, t_load = dist.get_rank(), time.time()
    if rank == 0:
        print(f"loading checkpoint from {args.load} at iteration {extra['iteration']}{note}", flush=True)
    run.iteration, run.consumed = load_checkpoint(ckpt, extra, parts.model, parts.optimizer, parts.scheduler)
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


def _iteration(args, run, data, parts, log):
    """One training iteration of ``parts`` (model, optimizer, scheduler), its log line and row, and the
    evaluation when it is due."""
    model, optimizer, scheduler = parts
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
            iteration=run.iteration,
            consumed_samples=run.consumed,
            lm_loss=f"{m['loss']:.8e}",
            lr=f"{lr:.6e}",
            grad_norm=f"{m['grad_norm']:.6f}",
            ms_per_iter=f"{dt * 1e3:.2f}",
            tokens_per_second=f"{tps:.1f}",
            peak_memory_gb=f"{peak:.3f}",
            kind="train",
        )
    if data.vsampler is not None and args.eval_interval and run.iteration % args.eval_interval == 0:
        _evaluate(args, run, data, model, log)


def _log_schedule(last: dict, step_seconds: float) -> None:
    share = last["exchanged_tokens"] / max(1, last["tokens"])
    busy, sched = last["predicted_busy_max_over_mean"], last["scheduler_seconds"]
    lo, hi = last["micro_batches"]
    print(
        f"   dynamic: {lo}-{hi} micro-batches a rank | documents by degree {last['documents']} | pad "
        f"{100 * last['pad_tokens'] / max(1, last['tokens']):.2f}% of tokens | all-to-all tokens "
        f"{share:.2f} of the fixed degree's | predicted busiest / mean rank {busy:.3f} | "
        f"scheduler {sched * 1e3:.1f} ms ({100 * sched / step_seconds:.2f}% of the step) |",
        flush=True,
    )


def _evaluate(args, run, data, model, log):
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
        log.row(iteration=run.iteration, consumed_samples=run.consumed, lm_loss=f"{val:.8e}", kind="valid")


def _exit_reason(args, run):
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
