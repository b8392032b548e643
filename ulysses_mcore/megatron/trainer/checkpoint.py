"""Checkpoints of the trainer: Megatron-Core's dist_checkpointing, saved atomically, checked on load.

Layout (Megatron-LM's): ``DIR/iter_0000042/`` (dist_checkpointing's torch_dist files -- under
``--use-torch-fsdp2`` torch.distributed.checkpoint's files of the sharded weights and optimizer,
Megatron-LM's torch_dcp -- plus ``train_state.pt``: iteration, consumed samples, scheduler, flags) and
``DIR/latest_checkpointed_iteration.txt``.  Added here: ``ulysses_manifest.json`` in each
checkpoint, every file's size and CRC-32, written at save time (the ranks share the hashing).

* Save: written into ``iter_N.tmp``; every rank's outcome is gathered, so a failure on one
  rank (a full disk, say) is the same error on every rank, the partial ``.tmp`` is removed and
  the previous checkpoint stays published.  Publishing never deletes the published copy before
  its replacement is in place: a re-saved ``iter_N`` is renamed ``iter_N.old`` first, and the
  loader falls back to it if a kill lands between the two renames.
* Load: :mod:`ulysses_mcore.megatron.trainer.resume` checks all of it on every rank first.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import time
import zlib
from multiprocessing.managers import SyncManager
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.distributed import TorchFullyShardedDataParallel

from ulysses_mcore.devtools.lifetime import children_die_with_this_process, die_with_parent
from ulysses_mcore.megatron.trainer.errors import is_collective_failure
from ulysses_mcore.megatron.trainer.training import chunked

MANIFEST = "ulysses_manifest.json"
TRAIN_STATE = "train_state.pt"
MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "position_embedding_type",
    "make_vocab_size_divisible_by",
    "vocab_size",
    "tokenizer_type",
    "normalization",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
    "kv_channels",
    "qk_layernorm",
)
# scheduler state key -> the flags it is computed from
SCHEDULE_FLAGS = {
    "max_lr": ("lr",),
    "min_lr": ("min_lr",),
    "lr_warmup_steps": ("lr_warmup_iters", "global_batch_size"),
    "lr_decay_steps": ("train_iters", "global_batch_size"),
    "lr_decay_style": ("lr_decay_style",),
    "start_wd": ("weight_decay",),
    "end_wd": ("weight_decay",),
    "wd_incr_steps": ("train_iters", "global_batch_size"),
    "wd_incr_style": (),
}


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; raised alike on every rank."""


def latest_file(d: str) -> str:
    return os.path.join(d, "latest_checkpointed_iteration.txt")


def iter_dir(d: str, iteration: int) -> str:
    return os.path.join(d, f"iter_{iteration:07d}")


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:240]}" if text else type(e).__name__


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ------------------------------------------------------------------------ schedule
def schedule_from_flags(args) -> dict:
    """The schedule this command line asks for: OptimizerParamScheduler's constructor keywords,
    which are also its state_dict keys (the trainer builds the scheduler from it)."""
    G = args.global_batch_size
    return {
        "max_lr": args.lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": args.lr_warmup_iters * G,
        "lr_decay_steps": args.train_iters * G,
        "lr_decay_style": args.lr_decay_style,
        "start_wd": args.weight_decay,
        "end_wd": args.weight_decay,
        "wd_incr_steps": args.train_iters * G,
        "wd_incr_style": "constant",
    }


# ------------------------------------------------------------------------ save
def _is_no_space(e: BaseException) -> bool:
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if "no space left" in str(x).lower() or "disk quota" in str(x).lower():
            return True
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
    return False


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _outcome(err: Optional[BaseException], path: str) -> Optional[dict]:
    if err is None:
        return None
    free = _free_bytes(path)
    # torch's zip writer reports a short write as "unexpected pos ..." without an errno: a full disk
    # is then recognised by the free space left when it failed
    nospace = _is_no_space(err) or (free is not None and free < (4 << 20))
    failures = getattr(err, "failures", None)  # torch's CheckpointException: {rank: the exception}
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            err = inner
    return {"rank": dist.get_rank(), "what": first_line(err), "nospace": nospace, "free": free}


def _hash_share(root: str, names: List[str]) -> dict:
    """Size and CRC-32 of this rank's share of ``names`` (every world_size-th file)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        name: {"size": os.path.getsize(os.path.join(root, name)), "crc32": crc32(os.path.join(root, name))}
        for i, name in enumerate(names)
        if i % world == rank
    }


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(8 << 20)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _list_files(root: str) -> List[str]:
    names = []
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel != MANIFEST:
                names.append(rel)
    return sorted(names)


def save_checkpoint(path, iteration, model, optimizer, scheduler, consumed_samples, args):
    """Save iteration ``iteration`` under ``path`` (every rank calls it).  Prints Megatron-LM's
    ``saving checkpoint at iteration`` / ``successfully saved checkpoint`` lines on rank 0.
    Each step ends with every rank agreeing on its outcome (the same error everywhere)."""
    rank = dist.get_rank()
    t0 = time.time()
    if rank == 0:
        print(f"saving checkpoint at iteration {iteration:7d} to {path} in torch_dist format", flush=True)
    final = iter_dir(path, iteration)
    tmp = final + ".tmp"
    err = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            err = e
    _raise_if_failed(gather(_outcome(err, path)), path, tmp, iteration)
    err = _write_state(
        tmp,
        iteration,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        consumed_samples=consumed_samples,
        args=args,
    )
    _raise_if_failed(gather(_outcome(err, path)), path, tmp, iteration)
    _write_manifest(path, tmp, iteration)
    publish_checkpoint(path, tmp, final, iteration)
    if rank == 0:
        print(
            f"successfully saved checkpoint from iteration {iteration:7d} to {path} ({time.time() - t0:.2f} s)",
            flush=True,
        )


_WRITER_MANAGER: list = []  # the results Manager handed to Megatron's checkpoint writer (one per process)


def writer_helpers_die_with_this_rank() -> None:
    """Megatron's checkpoint writer collects its workers' results through a ``multiprocessing``
    Manager -- a spawned server process it starts at the first save and keeps -- which outlives a
    rank that is killed.  Start that Manager here, with the parent-death signal armed in it, and
    hand its queue to Megatron (its module-level slot for it), before the first save.  Its forked
    writers get the signal from :func:`ulysses_mcore.devtools.lifetime.children_die_with_this_process`."""
    children_die_with_this_process()
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # not in every release
    except ImportError:
        return
    if _WRITER_MANAGER or getattr(fa, "_results_queue", "absent") is not None:
        return  # made already, or a megatron-core without that slot
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    fa._results_queue = manager.Queue()
    _WRITER_MANAGER.append(manager)


# the distributed optimizer's state as Megatron-LM saves it by default: per tensor x pipeline shard,
# reshardable over the data-parallel x Ulysses x ring ranks (the fully reshardable format fails to load
# in megatron-core 0.16 / 0.19 without apex or TE: its parameter state lacks Adam's step)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}


def model_keys(model) -> dict:
    """Megatron-LM's model entries of a checkpoint: ``model`` for one model, ``model0``,
    ``model1``, ... for a stage's chunks (each holds its layers by their global numbers, so a
    checkpoint loads into any chunking of the stages): key -> the GPTModel."""
    chunks = chunked(model)
    if len(chunks) == 1:
        return {"model": chunks[0].module}
    return {f"model{i}": chunk.module for i, chunk in enumerate(chunks)}


def sharded_model_state(model) -> dict:
    """The sharded state of every model entry (:func:`model_keys`)."""
    return {key: core.sharded_state_dict() for key, core in model_keys(model).items()}


def fully_sharded(model) -> bool:
    """A model in FSDP2's wrapper: its checkpoint is torch.distributed.checkpoint's (Megatron-LM's
    ``torch_dcp``) of the weights' and the optimizer's DTensor shards, reshardable over the ranks."""
    return isinstance(model, TorchFullyShardedDataParallel)


def _save_tensors(tmp, model, optimizer) -> None:
    """The model and optimizer, each rank its shards: Megatron's torch_dist, or DCP under FSDP2."""
    if fully_sharded(model):
        dcp.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=tmp)
        return
    model_sd = sharded_model_state(model)
    opt_sd = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
    dist_checkpointing.save({**model_sd, "optimizer": opt_sd}, tmp)


def _write_state(tmp, iteration, *, model, optimizer, scheduler, consumed_samples, args):
    """The sharded model and optimizer (every rank) and the train state (rank 0) into ``tmp``:
    this rank's error, or None (a failed collective is raised: it is not a save failure)."""
    writer_helpers_die_with_this_rank()
    try:
        _save_tensors(tmp, model, optimizer)
        if dist.get_rank() == 0:
            torch.save(
                {
                    "iteration": iteration,
                    "consumed_samples": consumed_samples,
                    "scheduler": scheduler.state_dict(),
                    "args": vars(args),
                },
                os.path.join(tmp, TRAIN_STATE),
            )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - gathered by the caller: the same error on every rank (torch's
        # CheckpointException derives from BaseException)
        if is_collective_failure(e):
            raise
        return e
    return None


def _write_manifest(path, tmp, iteration):
    """Every file's size and CRC-32 (the ranks share the reading), written by rank 0."""
    err = None
    try:
        share = _hash_share(tmp, _list_files(tmp))
    except OSError as e:
        share, err = {}, e
    shares = gather((share, _outcome(err, path)))
    if dist.get_rank() == 0 and not any(o for _, o in shares):
        try:
            files = {k: v for s, _ in shares for k, v in s.items()}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump({"format": 1, "iteration": iteration, "files": files}, f, indent=0, sort_keys=True)
        except OSError as e:
            err = e
    _raise_if_failed([o for _, o in shares] + gather(_outcome(err, path)), path, tmp, iteration)


def _previous(path: str) -> str:
    try:
        with open(latest_file(path)) as f:
            return f"iteration {int(f.read().strip())} stays the latest checkpoint"
    except (OSError, ValueError):
        return "no earlier checkpoint is published"


def _raise_if_failed(outcomes, path, tmp, iteration):
    """Every rank has the same ``outcomes``: remove the partial save and raise the same error."""
    bad = [o for o in outcomes if o]
    if not bad:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    first = bad[0]
    ranks = ", ".join(str(o["rank"]) for o in bad)
    kept = _previous(path)
    if any(o["nospace"] for o in bad):
        free = [o["free"] for o in bad if o["free"] is not None]
        raise CheckpointError(
            f"saving checkpoint at iteration {iteration} to {path}: no space left on the device "
            f"({min(free) if free else '?'} bytes free; rank(s) {ranks}: {first['what']}). The partial {tmp} was "
            f"removed and {kept}. Free space or point --save at a larger disk, then resume with --load {path}"
        )
    raise CheckpointError(
        f"saving checkpoint at iteration {iteration} to {path} failed on rank(s) {ranks}: "
        f"{first['what']}. The partial {tmp} was removed and {kept}"
    )


def publish_checkpoint(path, tmp, final, iteration):
    """Every rank's shards are in ``tmp``: put it in place as ``final`` and mark it latest.
    A ``final`` that exists (a re-run iteration) is renamed aside first and removed last, so
    a published copy exists at every instant."""
    dist.barrier()
    if dist.get_rank() == 0:
        old = final + ".old"
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        latest = latest_file(path) + ".tmp"
        with open(latest, "w") as f:
            f.write(str(iteration))
        os.replace(latest, latest_file(path))
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


# ------------------------------------------------------------------------ load
