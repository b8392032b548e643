"""The stand-ins Megatron-Core needs to build and run a model on fake CUDA without a GPU.

Megatron asks the CUDA runtime for three things a machine without a GPU cannot answer: the current
device's index (``torch.cuda.current_device()``, for parameters, RoPE and buffers), the CUDA RNG
state (the RNG tracker's ``fork`` around dropout and initialisation, activation recompute's saved
state) and pinned host memory
(``get_pos_emb_on_this_cp_rank``).  Inside :func:`stand_ins` each answers as it would on device 0
of a GPU node; nothing else of Megatron changes, and everything is restored on exit.  Used by the
dry run only (:mod:`ulysses_mcore.megatron.trainer.dryrun`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _no_rng_fork(self, name=None):
    return contextlib.nullcontext()  # fake tensors draw no random numbers: nothing to fork


class _NoPinning(TorchFunctionMode):
    """Pinned host memory needs a CUDA driver: ``pin_memory=True`` and ``Tensor.pin_memory()`` are
    dropped (fake tensors have no memory to pin)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory:
            return args[0]
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


@contextlib.contextmanager
def stand_ins():
    """Device 0 for ``current_device``, no CUDA RNG state to fork, pinning a no-op, and new
    tensors on CUDA by default (norms and buffers Megatron builds without a device)."""
    from megatron.core.tensor_parallel import random as mrandom  # only while the stand-ins are in force

    saved = (
        torch.cuda.current_device,
        mrandom.CudaRNGStatesTracker.fork,
        mrandom._get_cuda_rng_state,
        mrandom._set_cuda_rng_state,
    )
    torch.cuda.current_device = lambda: 0
    mrandom.CudaRNGStatesTracker.fork = _no_rng_fork
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8, device="cpu")  # recompute
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    try:
        with torch.device("cuda"), _NoPinning():
            yield
    finally:
        (
            torch.cuda.current_device,
            mrandom.CudaRNGStatesTracker.fork,
            mrandom._get_cuda_rng_state,
            mrandom._set_cuda_rng_state,
        ) = saved
