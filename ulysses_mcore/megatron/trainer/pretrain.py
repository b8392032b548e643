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

import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ulysses_mcore.devtools import lifetime
from ulysses_mcore.megatron.compat import cpu_compat
from ulysses_mcore.megatron.trainer.arguments import check_output_dirs, validate
from ulysses_mcore.megatron.trainer.errors import is_collective_failure
from ulysses_mcore.megatron.trainer.parser import build_parser, trainer_config


# ------------------------------------------------------------------------ main
def main(argv=None):
    run = RunState()
    args = build_parser(__doc__).parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        topo = validate(args, world_size)
        check_output_dirs(args, int(os.environ.get("RANK", "0")))
        args = trainer_config(args)  # one frozen record from here on
    except ValueError as e:  # every rank runs the same checks: every rank exits here, no collective yet
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.exit_signal_handler:  # Megatron-LM's: note SIGTERM, act on it at the end of the iteration
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(run, "signalled", True))
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
    # Megatron is imported only now (1.7 s of start-up): --help and a bad flag answer without it
    from ulysses_mcore.megatron.trainer import loop

    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=args.distributed_timeout_minutes))
    try:
        return loop.train(args, topo, run)
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
        traceback.print_exc()
        print(
            f"error: rank {rank}: {type(e).__name__} at iteration {it}: {first} (a local error on this rank; "
            f"the traceback above says where)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        loop.release(run)


class RunState:
    """One run's state: when it started, whether SIGTERM came, the iteration reached (for the
    error message of a failure), and the groups --dynamic-ulysses builds: what the loop advances."""

    def __init__(self):
        self.started = time.time()
        self.groups = None  # --dynamic-ulysses: every degree's groups (megatron.dynamic.DynamicGroups)
        self.signalled = False
        self.iteration = 0
        self.consumed = 0


if __name__ == "__main__":
    sys.exit(main())
