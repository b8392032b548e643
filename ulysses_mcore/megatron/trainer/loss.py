"""Token-weighted loss for sequence-sharded training.

The unsharded model's loss is ``sum(loss * mask) / sum(mask)`` over the whole global
batch.  Averaging per-rank means instead is wrong whenever shards hold different numbers
of valid tokens (one may hold none), and a differentiable all-gather of per-rank losses
gives P-fold gradients once DDP also sums them.  So each rank returns its *sum* and its
*count*, and Megatron-Core's per-token-loss mode does the rest exactly:

* the schedule adds up the counts of all micro-batches;
* ``finalize_model_grads`` all-reduces the count over ``dp x ulysses x cp`` and scales the
  (summed, not averaged: DDP's scaling factor is 1 in this mode) gradients by ``1/count``.

Use with ``TransformerConfig(calculate_per_token_loss=True)``; :func:`check_config` says so.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def check_config(config) -> None:
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "sequence-sharded training needs token-weighted loss: set "
            "TransformerConfig(calculate_per_token_loss=True) (Megatron-LM: --calculate-per-token-loss)"
        )


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron ``loss_func``: (sum of masked token losses, token count, report).

    ``output_tensor`` is GPTModel's per-token loss ``[b, s_local]``; ``report['lm loss']`` is
    ``[sum, count]`` (detached copies), to be all-reduced for logging by :func:`global_mean`."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().clone().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def global_mean(reports, group=None) -> Tuple[float, int]:
    """Sum ``[sum, count]`` reports of all micro-batches, all-reduce over ``group`` (default
    ``dp x ulysses x cp``), return (mean loss, token count)."""
    if not reports:
        return float("nan"), 0
    total = torch.stack([r["lm loss"] if isinstance(r, dict) else r for r in reports]).sum(0).double()
    if group is None:
        group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    count = int(total[1].item())
    return (total[0] / max(count, 1)).item(), count
