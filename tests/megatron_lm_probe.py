"""Test harness: run Megatron-LM's pretrain_gpt.py, unchanged, and print each iteration's loss
and grad norm in full precision (Megatron-LM prints 7 and 4 significant digits).

    python -m megatron_patches.launch tests/megatron_lm_probe.py $MEGATRON_LM/pretrain_gpt.py [flags]

It wraps ``megatron.training.training.train_step`` (called by name from ``train``) and prints
``PROBE <iteration> <loss> <grad_norm>`` on the rank that logs (the last pipeline stage's first
rank); everything else is Megatron-LM's own code path.
"""

import os
import runpy
import sys

import torch


def _loss(value):
    if torch.is_tensor(value):
        value = value.detach().double().view(-1)
        return (value[0] / value[1]).item() if value.numel() == 2 else value[0].item()
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return float(value[0]) / float(value[1])
    return float(value)


def main():
    script = sys.argv[1]
    import megatron.training.training as T

    original = T.train_step
    count = [0]

    def train_step(*a, **k):
        out = original(*a, **k)
        loss_reduced, grad_norm = out[0], out[5]
        count[0] += 1
        if loss_reduced and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            it = k.get("iteration") if k.get("iteration") is not None else count[0] - 1
            print(f"PROBE {it + 1} {_loss(loss_reduced['lm loss']):.17e} {float(grad_norm):.17e}", flush=True)
        return out

    T.train_step = train_step
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
