"""ulysses_mcore.megatron.trainer.timing: the phases of a step, measured in the step -- the all-to-alls and
their bytes, the attention kernel without them, the optimizer -- on a real module in a threaded world."""

import time

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType

from tests.helpers import run_threaded
from tests.test_module import config
from ulysses_mcore import UlyssesAttention
from ulysses_mcore.megatron.trainer.timing import StepTimer


class _Optimizer:
    def step(self):
        time.sleep(0.002)


def test_phases_and_bytes_of_a_step():
    S, b, heads, groups = 16, 2, 8, 2
    cfg = config(heads, groups)
    d = cfg.kv_channels

    def rank_fn(rank, world):
        mod = UlyssesAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, ulysses_group=dist.group.WORLD)
        opt = _Optimizer()
        timer = StepTimer(dist.group.WORLD, None).install(torch.nn.ModuleList([mod]), opt) if rank == 0 else None
        try:
            g = torch.Generator().manual_seed(rank)
            q = torch.randn(S // world, b, heads, d, generator=g, requires_grad=True)
            k, v = (torch.randn(S // world, b, groups, d, generator=g, requires_grad=True) for _ in range(2))
            mod(q, k, v, None).sum().backward()
            opt.step()
            return timer.take() if timer else None
        finally:
            if timer:
                timer.remove()

    rec = run_threaded(2, rank_fn)[0]
    # sent per rank, forward and backward alike: (P-1)/P of the q/k/v buffer (4 q + 1 kv + 1 kv heads a
    # destination) and of the output buffer (4 heads a destination), fp32
    tokens = S // 2 * b
    per_direction = (tokens * 2 * (4 + 1 + 1) * d + tokens * 2 * 4 * d) * 4 // 2
    assert rec["a2a_bytes"] == 2 * per_direction and rec["ring_bytes"] == 0
    assert rec["a2a_s"] > 0 and rec["attention_s"] > 0 and rec["optimizer_s"] >= 0.002
    assert rec["mlp_s"] == 0.0 and rec["ring_s"] == 0.0
    assert dist.all_to_all_single.__name__ == "all_to_all_single"  # removed: torch's function is back
