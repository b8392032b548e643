"""The training loop (ulysses_mcore.megatron.trainer.loop): Megatron-LM's exit checks -- by
--exit-interval with no collective, by SIGTERM or time agreed over a real gloo world (one rank's
signal stops every rank at the same iteration).  Whole runs: tests/test_pretrain.py."""

import argparse
import time

import torch.distributed as dist

from tests.helpers import run_threaded
from ulysses_mcore.megatron.trainer.loop import _exit_reason
from ulysses_mcore.megatron.trainer.pretrain import RunState


def _args(**kw):
    base = dict(exit_signal_handler=False, exit_duration_in_mins=None, exit_interval=None)
    return argparse.Namespace(**(base | kw))


def test_exit_interval_needs_no_collective():
    run = RunState()
    run.iteration = 10
    assert _exit_reason(_args(exit_interval=5), run) == "at iteration 10 (--exit-interval 5)"
    assert _exit_reason(_args(exit_interval=4), run) is None
    assert _exit_reason(_args(), run) is None


def test_one_ranks_signal_or_clock_stops_every_rank():
    def fn(rank, world):
        run = RunState()
        run.iteration = 3
        run.signalled = rank == 1  # SIGTERM reached rank 1 only
        signal = _exit_reason(_args(exit_signal_handler=True), run)
        run.signalled = False
        run.started = time.time() - (120 if rank == 0 else 0)  # only rank 0's clock ran out
        clock = _exit_reason(_args(exit_duration_in_mins=1.0), run)
        return signal, clock, dist.get_backend()

    for signal, clock, _ in run_threaded(2, fn):
        assert signal == "after receiving SIGTERM."
        assert clock is not None and clock.startswith("after ") and "--exit-duration-in-mins 1" in clock
