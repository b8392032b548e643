"""Test harness: the trainer with faults injected from outside it (product code carries none).

    ULYSSES_MCORE_FAULT="kind@iteration:rank,..." torchrun ... tests/fault_pretrain.py [trainer flags]

kinds: ``kill`` -- SIGKILL the rank as that iteration starts; ``kill_in_save`` -- after every rank
has written its shards of that iteration's checkpoint, before it is published; ``nan`` -- a NaN
in the first gradient after that iteration's backward.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from ulysses_mcore.megatron.trainer import checkpoint, pretrain, training  # noqa: E402

FAULTS = [
    (k, int(it), int(r))
    for k, rest in (item.split("@") for item in filter(None, os.environ.get("ULYSSES_MCORE_FAULT", "").split(",")))
    for it, r in [rest.split(":")]
]
_NOW = {"iteration": 0}


def _hit(kind, iteration):
    return any(k == kind and it == iteration and dist.get_rank() == r for k, it, r in FAULTS)


def _kill(kind, iteration):
    print(
        f"[fault injection] rank {dist.get_rank()} killed at iteration {iteration} ({kind})",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def _wrap_train_step(fn):
    def train_step(model, optimizer, microbatches, **kw):
        _NOW["iteration"] = kw.get("iteration")
        if _hit("kill", _NOW["iteration"]):
            _kill("kill", _NOW["iteration"])
        return fn(model, optimizer, microbatches, **kw)

    return train_step


def _wrap_forward_backward(fn):
    def forward_backward(model, *a, **kw):
        out = fn(model, *a, **kw)
        if not kw.get("forward_only") and _hit("nan", _NOW["iteration"]):
            next(p for p in model.module.parameters()).main_grad.view(-1)[0] = float("nan")
        return out

    return forward_backward


def _wrap_publish(fn):
    def publish_checkpoint(path, tmp, final, iteration):
        if _hit("kill_in_save", iteration):
            _kill("kill_in_save", iteration)
        return fn(path, tmp, final, iteration)

    return publish_checkpoint


training.train_step = _wrap_train_step(training.train_step)
training.forward_backward = _wrap_forward_backward(training.forward_backward)
checkpoint.publish_checkpoint = _wrap_publish(checkpoint.publish_checkpoint)

if __name__ == "__main__":
    sys.exit(pretrain.main())
