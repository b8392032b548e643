"""Run Megatron-Core on CPU (gloo) when CUDA is absent -- four shims, nothing inside Megatron changed.

Megatron-Core assumes a CUDA device in a few places that have nothing to do with the
math.  :func:`apply` (idempotent; a no-op when CUDA is available unless ``force``) installs:

1. ``torch.cuda.current_device()`` answers ``"cpu"``; ``torch.cuda.synchronize`` and
   ``torch.cuda.empty_cache`` are no-ops.
2. A ``TorchFunctionMode`` that maps ``device="cuda"``, ``Tensor.cuda()`` and pinned memory
   to the CPU,
   and answers ``Tensor.type()`` with the CUDA type names Megatron's optimizer asserts.
3. The CUDA RNG state Megatron's RNG tracker forks (dropout, init) is torch's CPU
   generator: ``torch.cuda.get_rng_state/set_rng_state/manual_seed`` and Megatron's
   ``_get_cuda_rng_state/_set_cuda_rng_state`` act on it.
4. ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` answer 0 (logging only).

:func:`remove` restores everything.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_SAVED: dict = {}
_MODE = None

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CpuForCuda(TorchFunctionMode):
    """Maps CUDA placement requests to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            return _CUDA_TYPE_NAMES.get(t.dtype, func(*args))
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to,) and args:
            args = tuple("cpu" if (i > 0 and _is_cuda(a)) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def active() -> bool:
    return bool(_SAVED)


def apply(force: bool = False) -> bool:
    """Install the shims if CUDA is absent (or ``force``); return whether they are active."""
    global _MODE
    if _SAVED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    import megatron.core.tensor_parallel.random as mrandom

    cuda = torch.cuda
    for name in ("current_device", "synchronize", "empty_cache", "get_rng_state", "set_rng_state",
                 "manual_seed", "manual_seed_all", "memory_allocated", "max_memory_allocated",
                 "reset_peak_memory_stats"):
        _SAVED[("cuda", name)] = getattr(cuda, name)
    _SAVED[("mrandom", "_get_cuda_rng_state")] = mrandom._get_cuda_rng_state
    _SAVED[("mrandom", "_set_cuda_rng_state")] = mrandom._set_cuda_rng_state

    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    _MODE = _CpuForCuda()
    _MODE.__enter__()
    return True


def remove() -> None:
    """Undo :func:`apply` (idempotent)."""
    global _MODE
    if not _SAVED:
        return
    import megatron.core.tensor_parallel.random as mrandom

    if _MODE is not None:
        _MODE.__exit__(None, None, None)
        _MODE = None
    for (where, name), fn in _SAVED.items():
        setattr(torch.cuda if where == "cuda" else mrandom, name, fn)
    _SAVED.clear()
