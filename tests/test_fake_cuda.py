"""The stand-ins Megatron needs on fake CUDA (ulysses_mcore.megatron.compat.fake_cuda): device 0, no CUDA RNG
state to fork, pinning dropped -- and everything as it was after the block."""

import contextlib

import torch


def test_stand_ins_answer_inside_and_restore_on_exit():
    from megatron.core.tensor_parallel import random as mrandom

    from ulysses_mcore.megatron.compat.fake_cuda import stand_ins

    before = (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork)
    with stand_ins():
        assert torch.cuda.current_device() == 0
        assert isinstance(mrandom.CudaRNGStatesTracker().fork(), contextlib.nullcontext)
        t = torch.ones(3, device="cpu", pin_memory=True)  # no CUDA driver: pinning is dropped
        assert t.pin_memory() is t and t.device.type == "cpu"
    assert (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork) == before
