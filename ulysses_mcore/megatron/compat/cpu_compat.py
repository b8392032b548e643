"""Run Megatron on CPU (gloo) when CUDA is absent -- the project's one CPU-compat module.

Megatron-Core and Megatron-LM's ``megatron.training`` assume a CUDA device in a few places
that have nothing to do with the math.  Nothing inside Megatron is edited; everything here
is installed only without CUDA (or with ``force``) and undone by :func:`remove`.

:func:`apply` (idempotent) -- for megatron-core:

1. ``torch.cuda.current_device()`` answers ``"cpu"``; ``torch.cuda.synchronize`` and
   ``torch.cuda.empty_cache`` are no-ops.
2. A ``TorchFunctionMode`` that maps ``device="cuda"``, ``Tensor.cuda()`` and pinned memory
   to the CPU,
   and answers ``Tensor.type()`` with the CUDA type names Megatron's optimizer asserts.
3. The CUDA RNG state Megatron's RNG tracker forks (dropout, init) is torch's CPU
   generator: ``torch.cuda.get_rng_state/set_rng_state/manual_seed`` and Megatron's
   ``_get_cuda_rng_state/_set_cuda_rng_state`` act on it.
4. ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` answer 0 (logging only).
5. CUDA streams: ``torch.cuda.Stream``, ``current_stream``, ``stream(...)`` and ``Event`` are
   torch's CPU stand-ins (megatron-core 0.19's DDP grad sync asks for the current stream
   unconditionally; Megatron-LM builds DDP inside a side stream).
6. Megatron-Core's MoE router reads ``moe_utils.te_general_gemm``, which it defines only when
   Transformer Engine imports: it is ``None`` (the router's own torch matmul) without TE.
7. The pipeline schedules' ``deallocate_output_tensor`` swaps a sent output's storage for a
   one-element tensor; gloo's asynchronous ``isend`` (the interleaved schedule overlaps its p2p)
   still reads the old storage, which is then freed and reused: the next stage received garbage
   (NaN at iteration 1 with Ulysses' allocations in between).  Each swapped-out storage is kept
   until the next pipelined ``forward_backward`` starts (NCCL records the storage in its work:
   GPUs need nothing).
8. ``parallel_state.get_nccl_options`` answers ``None``: NCCL communicator options (the
   high-priority stream Megatron-LM asks for its FSDP's data-parallel group) mean nothing to gloo.
9. Megatron's torch-FSDP2 wrapper builds its ``DeviceMesh`` on ``"cuda"``: on the CPU.

:func:`apply_megatron_lm` (idempotent; after :func:`apply`) -- for Megatron-LM's trainer:

10. ``initialize_megatron`` runs with ``allow_no_cuda=True`` (it asserts CUDA otherwise).
11. ``_initialize_distributed`` and ``_set_random_seed`` see one "device": without it they
   skip ``initialize_model_parallel`` and the model-parallel RNG seeds when
   ``torch.cuda.device_count() == 0``; ``torch.cuda.set_device`` is a no-op meanwhile.
12. ``megatron.legacy.fused_kernels.load`` does nothing (CUDA kernels; the CPU path never
   calls them), nor does ``_warmup_jit_function`` (it warms fused kernels up on CUDA tensors).
13. ``get_device_arch_version`` answers 0 (no CUDA architecture: Megatron-LM keeps its
   pre-Blackwell rules, e.g. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with context parallelism).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch
from torch.distributed import DeviceMesh
from torch.overrides import TorchFunctionMode

_SAVED: dict = {}
_ADDED: list = []  # (module, name) set where Megatron left a name undefined: deleted by remove()
_SENT: list = []  # storages of pipeline outputs a gloo isend may still read (shim 7)
_PIPELINED = ("forward_backward_pipelining_without_interleaving", "forward_backward_pipelining_with_interleaving")
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
    import megatron.core.tensor_parallel.random as mrandom  # only where the shims are installed

    cuda = torch.cuda
    for name in (
        "current_device",
        "synchronize",
        "empty_cache",
        "get_rng_state",
        "set_rng_state",
        "manual_seed",
        "manual_seed_all",
        "memory_allocated",
        "max_memory_allocated",
        "reset_peak_memory_stats",
    ):
        _SAVED[("torch.cuda", name)] = getattr(cuda, name)
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        _SAVED[(mrandom.__name__, name)] = getattr(mrandom, name)

    for name in ("Stream", "current_stream", "stream", "Event", "set_stream"):
        _SAVED[("torch.cuda", name)] = getattr(cuda, name)
    cuda.Stream = torch.cpu.Stream
    cuda.current_stream = lambda *a, **k: torch.cpu.current_stream()
    cuda.stream = torch.cpu.stream
    cuda.Event = torch.cpu.Event
    cuda.set_stream = lambda *a, **k: None
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

    _keep_sent_outputs()
    _patch("megatron.core.parallel_state", "get_nccl_options", lambda *a, **k: None)
    _fsdp2_mesh_on_cpu()
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _ADDED.append((moe_utils, "te_general_gemm"))

    _MODE = _CpuForCuda()
    _MODE.__enter__()
    return True


def remove() -> None:
    """Undo :func:`apply` (idempotent)."""
    global _MODE
    if not _SAVED:
        return
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
        _MODE = None
    for (modname, name), fn in _SAVED.items():
        setattr(importlib.import_module(modname), name, fn)
    _SAVED.clear()
    for mod, name in _ADDED:
        delattr(mod, name)
    _ADDED.clear()
    _SENT.clear()


class _CpuMesh:
    """``DeviceMesh`` as Megatron's torch-FSDP2 wrapper builds it (``from_group(group, "cuda")``),
    on the CPU."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _fsdp2_mesh_on_cpu() -> None:
    """Shim 9: torch FSDP2's mesh on the CPU (where torch has FSDP2 and Megatron its wrapper)."""
    try:
        fsdp2 = importlib.import_module("megatron.core.distributed.torch_fully_sharded_data_parallel")
    except ImportError:
        return
    if hasattr(fsdp2, "DeviceMesh"):
        _patch(fsdp2.__name__, "DeviceMesh", _CpuMesh)


def _keep_sent_outputs() -> None:
    """Shim 7: a pipeline output's storage outlives the gloo send that reads it."""
    sched = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    free = sched.deallocate_output_tensor

    @functools.wraps(free)
    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
        if deallocate_pipeline_outputs and isinstance(out, torch.Tensor):
            _SENT.append(out.data)
        return free(out, deallocate_pipeline_outputs)

    _patch(sched.__name__, "deallocate_output_tensor", deallocate_output_tensor)
    for name in _PIPELINED:
        _patch(sched.__name__, name, _after_last_sends(getattr(sched, name)))


def _after_last_sends(schedule):
    @functools.wraps(schedule)
    def run(*a, **k):
        _SENT.clear()  # the previous step's sends were received before its optimizer step
        return schedule(*a, **k)

    return run


@contextlib.contextmanager
def _one_device():
    """``torch.cuda.device_count()`` answers 1 and ``set_device`` is a no-op, inside only."""
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


def _with_one_device(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with _one_device():
            return fn(*a, **k)

    return wrapper


def _allow_no_cuda(fn):
    @functools.wraps(fn)
    def initialize_megatron(*a, **k):
        k["allow_no_cuda"] = True
        return fn(*a, **k)

    return initialize_megatron


def _patch(modname: str, name: str, new) -> None:
    mod = importlib.import_module(modname)
    if (modname, name) not in _SAVED and hasattr(mod, name):
        _SAVED[(modname, name)] = getattr(mod, name)
        setattr(mod, name, new)


def apply_megatron_lm(force: bool = False) -> bool:
    """Also adapt Megatron-LM's ``megatron.training`` (shims 10-13) when CUDA is absent; return
    whether they are active.  Needs Megatron-LM importable; applies :func:`apply` first."""
    if not apply(force):
        return False
    if ("megatron.training.initialize", "_initialize_distributed") in _SAVED:
        return True
    import megatron.training.initialize as init  # Megatron-LM (optional): only for its trainer

    init_fn = init.initialize_megatron
    _patch("megatron.training.initialize", "initialize_megatron", _allow_no_cuda(init_fn))
    for modname in ("megatron.training.training", "megatron.training"):
        mod = importlib.import_module(modname)
        if getattr(mod, "initialize_megatron", None) is init_fn:
            _patch(modname, "initialize_megatron", init.initialize_megatron)
    for name in ("_initialize_distributed", "_set_random_seed"):
        _patch("megatron.training.initialize", name, _with_one_device(getattr(init, name)))
    _patch("megatron.training.initialize", "_warmup_jit_function", lambda *a, **k: None)
    utils = importlib.import_module("megatron.training.utils")
    arch = getattr(utils, "get_device_arch_version", None)
    for modname in ("megatron.training.utils", "megatron.training.arguments"):
        if arch is not None and getattr(importlib.import_module(modname), "get_device_arch_version", None) is arch:
            _patch(modname, "get_device_arch_version", lambda: 0)
    try:
        importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:  # newer Megatron-LM: no legacy fused kernels to load
        pass
    else:
        _patch("megatron.legacy.fused_kernels", "load", lambda *a, **k: None)
    return True
