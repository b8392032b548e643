"""ulysses_mcore.megatron.compat.cpu_compat: the CPU shims apply without CUDA and remove cleanly."""

import torch


def test_cpu_compat_applies_without_cuda_and_removes_cleanly(monkeypatch):
    import megatron.core.tensor_parallel.random as mrandom

    from ulysses_mcore.megatron.compat import cpu_compat

    before = (torch.cuda.current_device, torch.cuda.get_rng_state, mrandom._set_cuda_rng_state)
    assert cpu_compat.apply() is True and cpu_compat.active()
    try:
        assert torch.cuda.current_device() == "cpu"
        t = torch.empty(3, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, pin_memory=True).device.type == "cpu"
        # the RNG tracker's state is torch's CPU generator
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        tr = CudaRNGStatesTracker()
        tr.add("x", 7)
        outside = torch.get_rng_state()
        with tr.fork("x"):
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outside)
        tr2 = CudaRNGStatesTracker()
        tr2.add("x", 7)
        with tr2.fork("x"):
            assert torch.equal(torch.rand(3), a)
    finally:
        cpu_compat.remove()
    assert not cpu_compat.active()
    assert (torch.cuda.current_device, torch.cuda.get_rng_state, mrandom._set_cuda_rng_state) == before
    assert torch.zeros(2).type() == "torch.FloatTensor"
    # with CUDA present the shims stay off
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() is False and not cpu_compat.active()
