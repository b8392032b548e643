"""Resuming from a checkpoint: every check before any tensor is read, then the load.

Every rank checks the same things -- the ``latest`` file, the manifest (missing, truncated or
corrupted files: the ranks split the reading and gather what they found), ``train_state.pt``, the
model flags, and the learning-rate schedule against the command line (Megatron-LM's
``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``) -- so every rank
raises the same :class:`~ulysses_mcore.megatron.trainer.checkpoint.CheckpointError`, naming the
path and the cause, or none does.  The files are :mod:`~ulysses_mcore.megatron.trainer.checkpoint`'s.
"""

from __future__ import annotations

import json
import os
from typing import List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint import FileSystemReader

from ulysses_mcore.megatron.trainer.checkpoint import (
    MANIFEST,
    MODEL_FLAGS,
    OPTIMIZER_METADATA,
    SCHEDULE_FLAGS,
    TRAIN_STATE,
    CheckpointError,
    crc32,
    first_line,
    flag_of,
    fully_sharded,
    gather,
    iter_dir,
    latest_file,
    model_keys,
    schedule_from_flags,
    sharded_model_state,
)


def _read_latest(load: str) -> int:
    lf = latest_file(load)
    if not os.path.exists(lf):
        raise CheckpointError(
            f"--load {load}: no {os.path.basename(lf)}; is it a checkpoint directory? "
            "(Megatron-LM's layout: iter_NNNNNNN/ folders and that file)"
        )
    with open(lf, "rb") as f:
        raw = f.read(200)
    text = raw.decode("utf-8", "replace").strip()
    if not text.isdigit():
        shown = repr(text[:40]) if text else "nothing"
        raise CheckpointError(
            f"--load {load}: {lf} holds {shown}, not an iteration number; write the iteration "
            f"of a complete iter_NNNNNNN folder into it (for iter_0000002: 2)"
        )
    return int(text)


def _check_files(ckpt: str) -> List[str]:
    """This rank's share of the damage in ``ckpt`` (all of it where there is no manifest)."""
    mpath = os.path.join(ckpt, MANIFEST)
    if not os.path.exists(mpath):
        return _check_without_manifest(ckpt) if dist.get_rank() == 0 else []
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable ({first_line(e)})"] if dist.get_rank() == 0 else []
    names = sorted(files)
    problems, present = [], []
    for i, name in enumerate(names):
        if i % dist.get_world_size() != dist.get_rank():
            continue
        p, want = os.path.join(ckpt, name), files[name]
        if not os.path.exists(p):
            problems.append(f"{p}: missing")
        elif os.path.getsize(p) != want["size"]:
            size = os.path.getsize(p)
            problems.append(
                f"{p}: "
                + (
                    "empty (0 bytes)"
                    if size == 0
                    else f"truncated ({size} of {want['size']} bytes)"
                    if size < want["size"]
                    else f"{size} bytes, saved as {want['size']}"
                )
            )
        else:
            present.append(name)
    for name in present:
        crc = crc32(os.path.join(ckpt, name))
        if crc != files[name]["crc32"]:
            problems.append(
                f"{os.path.join(ckpt, name)}: corrupted (CRC-32 {crc:08x}, saved as {files[name]['crc32']:08x})"
            )
    return problems


def _check_without_manifest(ckpt: str) -> List[str]:
    """A checkpoint written without a manifest: the torch_dist metadata and the sizes it implies."""
    meta = os.path.join(ckpt, ".metadata")
    if not os.path.exists(meta):
        return [f"{meta}: missing (not a complete torch_dist checkpoint)"]
    try:
        md = FileSystemReader(ckpt).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to parse is damage
        return [f"{meta}: unreadable ({first_line(e)})"]
    need = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(need.items()):
        p = os.path.join(ckpt, name)
        if not os.path.exists(p):
            problems.append(f"{p}: missing")
        elif os.path.getsize(p) < size:
            problems.append(f"{p}: truncated ({os.path.getsize(p)} of at least {size} bytes)")
    return problems


def inspect_checkpoint(args):
    """Every check before any tensor is read: (checkpoint folder, train state).  Collective
    (the ranks share the file checks); raises the same :class:`CheckpointError` on every rank."""
    load = args.load
    ckpt, note = _locate(load)
    problems = sorted(p for share in gather(_check_files(ckpt)) for p in share)
    if problems:
        more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
        raise CheckpointError(
            f"--load {load}: checkpoint {ckpt} is damaged: "
            + "; ".join(problems[:4])
            + more
            + f". Resume from another checkpoint (its iteration in {latest_file(load)}) or "
            "save this one again"
        )
    extra = _read_train_state(load, ckpt)
    saved = extra.get("args", {})
    diff = [
        f"{flag_of(k)} {saved.get(k)} (checkpoint) vs {getattr(args, k)} (now)"
        for k in MODEL_FLAGS
        if k in saved and saved.get(k) != getattr(args, k)
    ]
    if diff:
        raise CheckpointError(
            f"--load {load}: the checkpoint is from an incompatible model: "
            + "; ".join(diff)
            + ". Use the checkpoint's model flags (parallel degrees may change freely)"
        )
    _check_optimizer(load, saved, args)
    _check_schedule(load, extra["scheduler"], saved, args)
    return ckpt, extra, note


def _layout_of(flags: dict) -> str:
    """How a run's checkpoint holds its weights and optimizer: FSDP2's (with its precision) or DDP's."""
    if not flags.get("use_torch_fsdp2"):
        return "without --use-torch-fsdp2 (Megatron's DDP layout)"
    bf16 = "and" if flags.get("bf16") else "without"
    return f"with --use-torch-fsdp2 {bf16} --bf16 (FSDP2's shards in torch.distributed.checkpoint's format)"


def _check_optimizer(load, saved, args) -> None:
    """The optimizer state's format: FSDP2's or Megatron's DDP's (:func:`_layout_of`); the
    distributed optimizer's is saved per tensor x pipeline shard and model chunk (Megatron's
    ``dp_reshardable``: the data-parallel x Ulysses x ring ranks may change, tp, pp and the
    chunking not)."""
    if _layout_of(saved) != _layout_of(vars(args)):
        raise CheckpointError(
            f"--load {load}: the checkpoint was saved {_layout_of(saved)}; this run is "
            f"{_layout_of(vars(args))}: resume with the checkpoint's flags"
        )
    was = bool(saved.get("use_distributed_optimizer", False))
    if "use_distributed_optimizer" in saved and was != args.use_distributed_optimizer:
        raise CheckpointError(
            f"--load {load}: the checkpoint's optimizer state was saved "
            f"{'with' if was else 'without'} --use-distributed-optimizer: resume "
            f"{'with' if was else 'without'} it"
        )
    moved = [
        f"{flag_of(k)} {saved[k]} (checkpoint) vs {getattr(args, k)} (now)"
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
        if was and k in saved and saved[k] != getattr(args, k)
    ]
    if moved:
        raise CheckpointError(
            f"--load {load}: the distributed optimizer's state is saved per tensor x pipeline shard: "
            + "; ".join(moved)
            + ". Resume at the checkpoint's tp, pp and chunks (--ulysses-degree, --context-parallel-size and the "
            "data-parallel size may change)"
        )


def _locate(load):
    """(the folder of the latest iteration, a note when it is the copy an interrupted re-save replaced)."""
    iteration = _read_latest(load)
    ckpt = iter_dir(load, iteration)
    if not os.path.isdir(ckpt) and os.path.isdir(ckpt + ".old"):
        return ckpt + ".old", " (a re-save of that iteration was interrupted: using the copy it replaced)"
    if not os.path.isdir(ckpt):
        raise CheckpointError(
            f"--load {load}: {latest_file(load)} names iteration {iteration} but {ckpt} is missing; "
            "write the iteration of a complete iter_NNNNNNN folder into it"
        )
    return ckpt, ""


def _read_train_state(load, ckpt) -> dict:
    ts = os.path.join(ckpt, TRAIN_STATE)
    if not os.path.exists(ts):
        raise CheckpointError(f"--load {load}: {ts} is missing: {ckpt} is incomplete")
    if os.path.getsize(ts) == 0:
        raise CheckpointError(f"--load {load}: {ts} is empty (0 bytes): {ckpt} is damaged")
    try:
        extra = torch.load(ts, weights_only=False, map_location="cpu")
        if not isinstance(extra, dict) or "iteration" not in extra or "scheduler" not in extra:
            raise ValueError("not a train state (no iteration / scheduler)")
    except Exception as e:  # noqa: BLE001 - whatever unpickling says, the file is bad
        raise CheckpointError(
            f"--load {load}: {ts} is not a readable train state ({first_line(e)}): {ckpt} is damaged"
        ) from None
    return extra


def _check_schedule(load, sched, saved, args):
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    now = schedule_from_flags(args)
    keys = [k for k in now if k in sched and sched[k] != now[k]]
    if not keys:
        return
    flags = []
    for k in keys:
        for f in SCHEDULE_FLAGS[k]:
            if f in saved and saved[f] != getattr(args, f) and f not in flags:
                flags.append(f)
    what = "; ".join(f"{flag_of(f)} {saved[f]} (checkpoint) vs {getattr(args, f)} (now)" for f in flags) or "; ".join(
        f"{k} {sched[k]} (checkpoint) vs {now[k]} (now)" for k in keys
    )
    raise CheckpointError(
        f"--load {load}: the learning-rate schedule differs from the checkpoint's: {what}. Add "
        "--override-opt_param-scheduler to go on with this command line's schedule, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's (Megatron-LM's flags)"
    )


def _torch_adams(optimizer, wrappers=(DistributedOptimizer,)) -> list:
    """The torch Adams inside Megatron's optimizer(s) of the kinds ``wrappers`` (none with apex's or
    TE's fused Adam)."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    inners = [getattr(opt, "optimizer", None) for opt in chain if isinstance(opt, wrappers)]
    return [inner for inner in inners if isinstance(inner, torch.optim.Adam)]


def _allocate_adam_state(optimizer, wrappers=(DistributedOptimizer,)) -> None:
    """Adam's state (zero moments, step 0) on each parameter of a torch Adam that has taken no step, to
    be overwritten by the load: Megatron's distributed optimizer reads the step from that state when
    neither apex nor Transformer Engine provides its fused Adam (the CPU, megatron-core 0.16 and 0.19),
    and torch.distributed.checkpoint loads into the tensors it is given (FSDP2: each a DTensor shard)."""
    for inner in _torch_adams(optimizer, wrappers):
        if inner.state:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {
                    "step": torch.tensor(0.0, device="cpu"),  # where torch Adam keeps it (not fused)
                    "exp_avg": torch.zeros_like(p.data),
                    "exp_avg_sq": torch.zeros_like(p.data),
                }


def _restore_adam_steps(optimizer) -> None:
    """Each parameter's Adam step from its group's, as loaded: megatron-core's distributed optimizer
    without apex / TE copies the placeholder step of :func:`_allocate_adam_state` over the loaded one
    (it shares one step tensor between the parameters, then copies each parameter's template into it)."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), device="cpu")


def _load_fully_sharded(ckpt, model, optimizer) -> None:
    """FSDP2's checkpoint (torch.distributed.checkpoint) into the weights' and Adam's shards in place."""
    _allocate_adam_state(optimizer, wrappers=(MegatronOptimizer,))
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _load_sharded(ckpt, model, optimizer) -> None:
    """Megatron's torch_dist checkpoint into every model entry and the optimizer."""
    model_sd = sharded_model_state(model)
    _allocate_adam_state(optimizer)
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)  # Adam's moments
    state = dist_checkpointing.load({**model_sd, "optimizer": opt_sd}, ckpt)
    for key, core in model_keys(model).items():
        core.load_state_dict(state[key])
    with torch.no_grad():  # fp32 weights: the distributed optimizer's main params are views of them
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(optimizer)


def load_checkpoint(ckpt, extra, model, optimizer, scheduler):
    """Load an inspected checkpoint into the model, optimizer and scheduler: (iteration, consumed samples)."""
    (_load_fully_sharded if fully_sharded(model) else _load_sharded)(ckpt, model, optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    return extra["iteration"], extra["consumed_samples"]
