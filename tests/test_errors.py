"""ulysses_mcore.megatron.trainer.errors: a failed collective is told apart from a local error."""

import torch.distributed as dist

from ulysses_mcore.megatron.trainer.errors import is_collective_failure


def test_only_a_failed_collective_is_reported_as_a_dead_peer():
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5")
    assert is_collective_failure(gloo)
    assert is_collective_failure(dist.DistBackendError("NCCL error in: ... unhandled system error"))
    for local in (
        RuntimeError("Torch not compiled with CUDA enabled"),
        AttributeError("no attribute 'x'"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
        KeyError("lm loss"),
    ):
        assert not is_collective_failure(local), local
