"""ulysses_mcore.megatron.trainer.checkpoint: what can be checked without a world -- the schedule a
command line asks for (the latest-iteration file and the metrics on resume: tests/test_resume.py).  Saving,
damage detection and resuming run in spawned worlds: tests/test_catalogue.py, tests/test_reliability.py."""

import argparse


from ulysses_mcore.megatron.trainer.checkpoint import (
    schedule_from_flags,
)


def test_schedule_counts_samples():
    a = argparse.Namespace(
        global_batch_size=8,
        lr=1e-3,
        min_lr=1e-4,
        lr_warmup_iters=2,
        train_iters=10,
        lr_decay_style="cosine",
        weight_decay=0.1,
    )
    s = schedule_from_flags(a)
    assert (s["lr_warmup_steps"], s["lr_decay_steps"], s["max_lr"]) == (16, 80, 1e-3)
