"""The stand-ins Megatron-Core needs to build and run a model on fake CUDA without a GPU.

Megatron asks the CUDA runtime for four things a machine without a GPU cannot answer: the current
device's index (``torch.cuda.current_device()``, for parameters, RoPE and buffers), the CUDA RNG
state (the RNG tracker's ``fork`` around dropout and initialisation, activation recompute's saved
state), streams (the hybrid-device optimizer's copies to and from the host) and pinned host memory
(``get_pos_emb_on_this_cp_rank``); its DDP batches collectives in a way fake tensors cannot run
(torch's ``_coalescing_manager``).  Inside :func:`stand_ins` each answers as it would on device 0
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


class _Issued:
    """The handle of collectives issued one by one: each finished when issued (fake tensors)."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    """Megatron's DDP batches its buffers' all-gathers and reduce-scatters in torch's
    ``_coalescing_manager``, whose coalesced collectives fake tensors cannot run: here each is
    issued on its own (the same tensors, the same bytes)."""
    yield _Issued()


class _OneStream:
    """A CUDA stream or event on a machine without one: fake tensors run in program order, so
    every wait is already met (the bytes each stream's copies make are the same)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, event=None) -> _OneStream:
        return self

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _table():
    """``(owner, attribute, stand-in)``: what :func:`stand_ins` replaces while in force."""
    from megatron.core.distributed import param_and_grad_buffer as buffers  # only while in force
    from megatron.core.tensor_parallel import random as mrandom

    return [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "current_stream", lambda device=None: _OneStream()),
        (torch.cuda, "Stream", _OneStream),
        (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (mrandom.CudaRNGStatesTracker, "fork", _no_rng_fork),
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8, device="cpu")),
        (mrandom, "_set_cuda_rng_state", lambda *a, **k: None),
        (buffers, "_coalescing_manager", _one_by_one),
    ]


@contextlib.contextmanager
def stand_ins():
    """Device 0 for ``current_device``, streams whose waits are met, no CUDA RNG state to fork
    (nor to save for recompute), pinning a no-op, DDP's coalesced collectives issued one by one,
    and new tensors on CUDA by default (norms and buffers Megatron builds without a device)."""
    table = _table()
    saved = [getattr(owner, name) for owner, name, _ in table]
    for owner, name, stand_in in table:
        setattr(owner, name, stand_in)
    try:
        with torch.device("cuda"), _NoPinning():
            yield
    finally:
        for (owner, name, _), original in zip(table, saved):
            setattr(owner, name, original)
