"""The trainer: pretrain a GPT with Megatron-Core and Ulysses sequence parallelism.

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --ulysses-degree 2 --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 30 --lr 3e-3

Megatron-LM's flag names and meanings.  NCCL on GPUs, gloo on CPU, chosen automatically.
Without --data-path it trains on the embedded corpus (package data, byte-level tokens).
``examples/pretrain_gpt.py`` and ``python -m ulysses_mcore.megatron.pretrain`` both run
:func:`main`.  The loop
is Megatron-Core's: GPTModel from a Ulysses layer spec, DistributedDataParallel,
get_megatron_optimizer + OptimizerParamScheduler, get_forward_backward_func (pipeline
schedules), GPTDataset via BlendedMegatronDatasetBuilder, dist_checkpointing.
Checkpoints do not depend on the Ulysses degree (or TP/PP): resume with other degrees.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--ulysses-degree", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="collective timeout: a dead peer fails the others within it")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups KV heads (1 if not given)")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="KV heads (implies --group-query-attention here; Megatron-LM needs both)")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLP (ffn default int(8h/3 / 64) * 64, as Megatron-LM)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (default: tied to the input embedding, as Megatron-LM)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="default 0 here (Megatron-LM: 0.1); dropout masks depend on the layout")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="default 0 here (Megatron-LM: 0.1)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="Megatron-Core's local spec (plain torch, CPU) or Transformer Engine's (GPU)")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted for Megatron-LM command lines; "
                   "the model is always Megatron-Core's GPTModel")
    g.add_argument("--attention-backend", choices=["auto", "sdpa", "flash", "te"], default="auto")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=3)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--on-nan", choices=["stop", "skip"], default="stop",
                   help="NaN/Inf in loss or gradients: stop the run, or skip that update")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None, help="prefix of a .bin/.idx indexed dataset")
    g.add_argument("--split", default="98,2,0")
    g.add_argument("--tokenizer-type", choices=["ByteTokenizer"], default="ByteTokenizer")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="documents (split at EOD) do not attend to each other: each micro-batch is packed "
                        "into one THD stream with cu_seqlens (no [s, s] mask is ever built)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each EOD (learned absolute embeddings; RoPE is relative)")
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-dir", default=None, help="CSV metrics go here (default: --save or runs/)")
    return p


def validate(args, world_size: int):
    """Every check that needs no collective; raises ValueError naming the flag and the fix."""
    from ulysses_mcore.topology import Topology

    if args.group_query_attention and args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default for --num-query-groups
    topo = Topology(world_size, tp=args.tensor_model_parallel_size, ulysses=args.ulysses_degree,
                    cp=args.context_parallel_size, pp=args.pipeline_model_parallel_size)
    topo.check_model(args.num_attention_heads, args.num_query_groups, args.seq_length)
    if args.context_parallel_size > 1 and args.attention_backend == "flash":
        raise ValueError("--context-parallel-size > 1 runs the ring with --attention-backend sdpa (log-sum-exp "
                         "ring) or te (Transformer Engine's p2p ring), not flash")
    if args.context_parallel_size > 1 and args.attention_backend == "te" and args.reset_attention_mask:
        raise ValueError("--reset-attention-mask with --context-parallel-size > 1 needs --attention-backend sdpa "
                         "(Transformer Engine's ring takes unpacked causal input only)")
    if args.num_layers % args.pipeline_model_parallel_size:
        raise ValueError(f"--num-layers {args.num_layers} must be divisible by "
                         f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} must be divisible by "
                         f"--num-attention-heads {args.num_attention_heads}")
    if args.global_batch_size % (args.micro_batch_size * topo.dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {topo.dp} "
                         f"(world {world_size} / (tp x ulysses x cp x pp))")
    for flag in ("train_iters", "micro_batch_size", "global_batch_size", "log_interval"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0 (0: no evaluation), got {args.eval_iters}")
    for flag in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            raise ValueError(f"--{flag.replace('_', '-')} must be in [0, 1), got {getattr(args, flag)}")
    if args.init_method_std <= 0:
        raise ValueError(f"--init-method-std must be > 0, got {args.init_method_std}")
    if args.transformer_impl == "transformer_engine" and not torch.cuda.is_available():
        raise ValueError("--transformer-impl transformer_engine needs a CUDA GPU with Transformer Engine; "
                         "use --transformer-impl local on CPU")
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save DIR")
    if args.load and not os.path.isdir(args.load):
        raise ValueError(f"--load {args.load} is not a directory")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and not torch.cuda.is_available():
        raise ValueError("--sequence-parallel needs Transformer Engine or apex norms (GPU); on CPU drop the flag")
    if args.attention_backend in ("flash", "te") and not torch.cuda.is_available():
        raise ValueError(f"--attention-backend {args.attention_backend} needs a CUDA GPU; use sdpa on CPU")
    if args.lr_warmup_iters >= args.train_iters and args.train_iters > 1:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be < --train-iters {args.train_iters}")
    return topo


# ------------------------------------------------------------------------ checkpoints
def _latest_file(d):
    return os.path.join(d, "latest_checkpointed_iteration.txt")


MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "position_embedding_type", "make_vocab_size_divisible_by", "tokenizer_type", "normalization",
               "swiglu", "untie_embeddings_and_output_weights", "disable_bias_linear")


def save_checkpoint(path, iteration, model, optimizer, scheduler, consumed_samples, args):
    """Atomic: written into iter_N.tmp, renamed to iter_N when every rank is done, then
    ``latest`` is replaced atomically -- a save killed half-way leaves the previous
    checkpoint complete and marked latest."""
    from megatron.core import dist_checkpointing

    final = os.path.join(path, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd = model.module.sharded_state_dict()
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(state, tmp)
    if dist.get_rank() == 0:
        torch.save({"iteration": iteration, "consumed_samples": consumed_samples,
                    "scheduler": scheduler.state_dict(), "args": vars(args)}, os.path.join(tmp, "train_state.pt"))
    publish_checkpoint(path, tmp, final, iteration)


def publish_checkpoint(path, tmp, final, iteration):
    """Every rank's shards are in ``tmp``: rename it to ``final`` and mark it latest (atomically)."""
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = _latest_file(path) + ".tmp"
        with open(latest, "w") as f:
            f.write(str(iteration))
        os.replace(latest, _latest_file(path))
    dist.barrier()


def load_checkpoint(path, model, optimizer, scheduler, args):
    from megatron.core import dist_checkpointing

    if not os.path.exists(_latest_file(path)):
        raise ValueError(f"--load {path}: no {os.path.basename(_latest_file(path))}; is it a checkpoint directory?")
    with open(_latest_file(path)) as f:
        iteration = int(f.read().strip())
    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if not os.path.exists(os.path.join(ckpt, "train_state.pt")):
        raise ValueError(f"--load {path}: latest names iteration {iteration} but {ckpt} is incomplete or missing")
    extra = torch.load(os.path.join(ckpt, "train_state.pt"), weights_only=False)
    saved = extra.get("args", {})
    diff = [f"--{k.replace('_', '-')} {saved.get(k)} (checkpoint) vs {getattr(args, k)} (now)"
            for k in MODEL_FLAGS if k in saved and saved.get(k) != getattr(args, k)]
    if diff:
        raise ValueError(f"--load {path}: the checkpoint is from an incompatible model: " + "; ".join(diff)
                         + ". Use the checkpoint's model flags (parallel degrees may change freely)")
    model_sd = model.module.sharded_state_dict()
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=True)  # creates the Adam moments to fill
    state = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, ckpt)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(extra["scheduler"])
    return extra["iteration"], extra["consumed_samples"]


# ------------------------------------------------------------------------ main
def main(argv=None):
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        topo = validate(args, world_size)
    except ValueError as e:  # every rank runs the same checks: every rank exits here, no collective yet
        print(f"error: {e}", file=sys.stderr)
        return 2

    from ulysses_mcore.megatron import cpu_compat

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu_compat.apply()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or "1")))
    if "RANK" not in os.environ:  # plain `python examples/pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    from datetime import timedelta

    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=args.distributed_timeout_minutes))
    try:
        return train(args, topo, use_cuda)
    except (ValueError, FileNotFoundError) as e:  # raised alike on every rank (data, checkpoint checks)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as e:  # NaN/Inf with --on-nan stop: every rank raises it at the same iteration
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except Exception as e:  # noqa: BLE001 - reported as what it is, on this rank
        rank, it = dist.get_rank(), _PROGRESS["iteration"] + 1
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        if _is_collective_failure(e):
            print(f"error: rank {rank}: a collective failed at iteration {it} -- a peer rank died or stopped "
                  f"responding within --distributed-timeout-minutes {args.distributed_timeout_minutes} "
                  f"({type(e).__name__}: {first}). Check the other ranks' logs.", file=sys.stderr, flush=True)
            return 4
        import traceback

        traceback.print_exc()
        print(f"error: rank {rank}: {type(e).__name__} at iteration {it}: {first} (a local error on this rank; "
              f"the traceback above says where)", file=sys.stderr, flush=True)
        return 1
    finally:
        from ulysses_mcore.megatron import groups

        groups.destroy()
        dist.destroy_process_group()


_PROGRESS = {"iteration": 0}

# what torch.distributed's backends say when a peer dies, a connection breaks or a wait times out
_COLLECTIVE_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
                     "timeout", "nccl error", "ncclremoteerror", "ncclsystemerror", "gloo/transport",
                     "socket closed", "connection refused")


def _is_collective_failure(e: BaseException) -> bool:
    """A failed collective (peer death, broken connection, timeout), not a local error."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(sign in text for sign in _COLLECTIVE_SIGNS)


def train(args, topo, use_cuda):
    import ulysses_mcore
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ulysses_mcore.megatron import data as D
    from ulysses_mcore.megatron import training
    from ulysses_mcore.megatron.batch import document_boundaries, pack_batch, reset_position_ids, shard_batch
    from ulysses_mcore.megatron.specs import get_ulysses_layer_spec

    ulysses_mcore.initialize(tp=topo.tp, ulysses=topo.ulysses, cp=topo.cp, pp=topo.pp,
                             distributed_timeout_minutes=max(1, int(math.ceil(args.distributed_timeout_minutes))),
                             num_attention_heads=args.num_attention_heads,
                             num_query_groups=args.num_query_groups, seq_length=args.seq_length)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    rank = dist.get_rank()

    # ---- data
    tok = D.ByteTokenizer()
    prefix = args.data_path
    if prefix is None:
        prefix = os.path.join(args.log_dir or "runs", "data", "kjv")
        if rank == 0 and not os.path.exists(prefix + ".idx"):
            D.write_indexed_dataset(D.read_documents(D.EMBEDDED_CORPUS), prefix, tok, progress=False)
        dist.barrier()
    G = args.global_batch_size
    n_eval = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else 0
    train_ds, valid_ds, _ = D.build_gpt_datasets(prefix, seq_length=args.seq_length, seed=args.seed,
                                                 split=args.split, samples=[args.train_iters * G, n_eval * G, 0],
                                                 tokenizer=tok)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sampler = D.GlobalBatchSampler(train_ds, global_batch_size=G, micro_batch_size=args.micro_batch_size,
                                   dp_size=dp, dp_rank=dp_rank)
    vsampler = D.GlobalBatchSampler(valid_ds, global_batch_size=G, micro_batch_size=args.micro_batch_size,
                                    dp_size=dp, dp_rank=dp_rank) if valid_ds is not None and n_eval else None

    # ---- model, optimizer, scheduler
    # padded independently of tp (unlike Megatron-LM), so checkpoints reshard across tp
    vocab = int(math.ceil(tok.vocab_size / args.make_vocab_size_divisible_by) * args.make_vocab_size_divisible_by)
    if vocab % topo.tp:
        raise ValueError(f"padded vocab {vocab} is not divisible by --tensor-model-parallel-size {topo.tp}: "
                         "raise --make-vocab-size-divisible-by to a multiple of it")
    te = args.transformer_impl == "transformer_engine"
    backend = args.attention_backend if args.attention_backend != "auto" else ("te" if te else "sdpa")
    ffn = args.ffn_hidden_size or (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                   else 4 * args.hidden_size)
    cfg = training.gpt_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=ffn,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear, init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method="uniform" if args.recompute_granularity == "full" else None,
        recompute_num_layers=1 if args.recompute_granularity == "full" else None,
    )
    base = "te" if (te or backend == "te") else "local"
    model = training.build_gpt(cfg, vocab_size=vocab, max_sequence_length=args.max_position_embeddings or args.seq_length,
                               position_embedding_type=args.position_embedding_type,
                               share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                               layer_spec=get_ulysses_layer_spec(base, backend=backend, normalization=args.normalization))
    # the same initial model for every tp / pp / ulysses / cp / dp layout (one --seed)
    training.init_layout_independent(model, cfg, args.seed)
    optimizer = training.build_optimizer(model, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                         clip_grad=args.clip_grad, bf16=args.bf16,
                                         use_distributed_optimizer=args.use_distributed_optimizer,
                                         adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                                         adam_eps=args.adam_eps)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * G, lr_decay_steps=args.train_iters * G, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * G,
        wd_incr_style="constant",
    )
    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = load_checkpoint(args.load, model, optimizer, scheduler, args)
        if rank == 0:
            print(f"[ulysses-mcore] resumed from {args.load} at iteration {iteration} "
                  f"({consumed} samples consumed)", flush=True)

    # ---- logging target: first rank of the last pipeline stage
    is_logger = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                 and dp_rank == 0 and ps.get_context_parallel_rank() == 0)
    log_dir = args.log_dir or args.save or "runs"
    writer = None
    if is_logger:
        os.makedirs(log_dir, exist_ok=True)
        fresh = not os.path.exists(os.path.join(log_dir, "metrics.csv")) or not args.load
        fh = open(os.path.join(log_dir, "metrics.csv"), "w" if fresh else "a", newline="")
        writer = csv.writer(fh)
        if fresh:
            writer.writerow(["iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "ms_per_iter",
                             "tokens_per_second", "peak_memory_gb", "kind"])
    seq = args.seq_length

    def shard(mbs):
        if args.reset_attention_mask:  # one packed THD stream per micro-batch, documents split at EOD
            return [shard_batch(pack_batch(mb, tok.eod, reset_positions=args.reset_position_ids)) for mb in mbs]
        if args.reset_position_ids:
            mbs = [reset_position_ids(mb, tok.eod) for mb in mbs]
        return [shard_batch(mb, load_balanced=True) for mb in mbs]

    # a packed micro-batch is one stream of micro-batch-size x seq-length tokens
    sched_seq, sched_mbs = (seq * args.micro_batch_size, 1) if args.reset_attention_mask else (seq, args.micro_batch_size)

    if args.reset_attention_mask and rank == 0:
        first = sampler.microbatches(consumed)
        n_docs = sum(len(document_boundaries(mb["tokens"], tok.eod)) - 1 for mb in first)
        print(f"[ulysses-mcore] --reset-attention-mask: each micro-batch is one packed THD stream of "
              f"{args.micro_batch_size} x {seq} tokens split at EOD (cu_seqlens, no [s, s] mask); "
              f"{n_docs} documents in rank 0's first {len(first)} micro-batches", flush=True)
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        mbs = shard(sampler.microbatches(consumed))
        lr = optimizer.param_groups[0]["lr"]
        m = training.train_step(model, optimizer, mbs, seq_length=sched_seq, micro_batch_size=sched_mbs,
                                scheduler=scheduler, increment=G, iteration=iteration + 1,
                                on_nonfinite=args.on_nan)
        iteration += 1
        consumed += G
        _PROGRESS["iteration"] = iteration
        dt = time.perf_counter() - t0
        if m["skipped"] and is_logger:
            print(f"[ulysses-mcore] {m['message']}: update skipped (--on-nan skip)", flush=True)
        peak = (torch.cuda.max_memory_allocated() if use_cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9
        tps = G * seq / dt
        if is_logger and iteration % args.log_interval == 0:
            print(f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {consumed:12d} | "
                  f"elapsed time per iteration (ms): {dt * 1e3:.1f} | learning rate: {lr:.6E} | "
                  f"global batch size: {G:5d} | lm loss: {m['loss']:.6E} | grad norm: {m['grad_norm']:.3f} | "
                  f"tokens per second: {tps:.0f} | peak memory (GB): {peak:.2f} |", flush=True)
            writer.writerow([iteration, consumed, f"{m['loss']:.8e}", f"{lr:.6e}", f"{m['grad_norm']:.6f}",
                             f"{dt * 1e3:.2f}", f"{tps:.1f}", f"{peak:.3f}", "train"])
            fh.flush()
        if vsampler is not None and args.eval_interval and iteration % args.eval_interval == 0:
            losses = [training.evaluate(model, shard(vsampler.microbatches(i * G)), seq_length=sched_seq,
                                        micro_batch_size=sched_mbs) for i in range(args.eval_iters)]
            if is_logger:
                val = sum(losses) / len(losses)
                print(f" validation loss at iteration {iteration} | lm loss value: {val:.6E} | "
                      f"lm loss PPL: {math.exp(min(val, 50)):.6E} |", flush=True)
                writer.writerow([iteration, consumed, f"{val:.8e}", "", "", "", "", "", "valid"])
                fh.flush()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args.save, iteration, model, optimizer, scheduler, consumed, args)
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        save_checkpoint(args.save, iteration, model, optimizer, scheduler, consumed, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
