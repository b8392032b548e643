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


def test_gradients_checked_are_the_buffers_else_each_parameters_local_gradient():
    """DDP's flat buffers when the model has them; else each parameter's gradient -- Megatron's
    main_grad first, and under FSDP2 the local shard of a DTensor gradient (``to_local``)."""
    from types import SimpleNamespace as NS

    import torch

    from ulysses_mcore.megatron.trainer.errors import gradient_buffers

    local = torch.ones(1)
    shard = NS(to_local=lambda: local)  # a DTensor's interface for this purpose: its local tensor
    params = [
        NS(main_grad=torch.ones(2), grad=None),
        NS(grad=torch.full((2,), float("nan"))),
        NS(grad=None),  # no gradient: skipped
        NS(grad=shard),
    ]
    core = NS(parameters=lambda: iter(params))
    got = gradient_buffers(NS(module=core, buffers=None, expert_parallel_buffers=[]))
    assert len(got) == 3 and torch.equal(got[0], torch.ones(2)) and torch.isnan(got[1]).all() and got[2] is local
    flat = torch.zeros(4)
    with_buffers = NS(module=core, buffers=[NS(grad_data=flat)], expert_parallel_buffers=[])
    assert gradient_buffers(with_buffers) == [flat]
