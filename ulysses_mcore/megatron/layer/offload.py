"""Activation checkpoints in pinned host memory, prefetched for the backward (ALST's offload).

Under full recompute (``--recompute-granularity full``) each checkpointed layer keeps only its
input ``[s/P, b, h]`` for the backward -- ``layers x s/P x b x h`` bytes that grow with the
sequence and do not shrink with recompute.  Megatron-Core's own fine-grained activation offloading
moves the tensors of named sub-modules through Transformer Engine's CPU offload; it does not take
the inputs Megatron's ``CheckpointFunction`` saves.  :func:`enable_activation_offload` runs a built
``GPTModel``'s forward under :class:`HostOffload`, torch's saved-tensor hooks:

* pack (forward): a CUDA tensor of at least ``min_bytes`` is copied into a pinned host buffer on a
  side stream (the device copy is released once the copy is done: ``record_stream``);
* unpack (backward): the tensor comes back on the side stream (already on its way, or now) and the
  compute stream waits for it; the copy of the tensor the backward needs next (the one saved before
  it in the same forward) starts at the region's :func:`prefetch_point` -- after layer ``i``'s
  attention backward, so the transfer of layer ``i - 1``'s input overlaps the rest of layer ``i``'s
  backward, and is not on the device at that layer's peak (the dry run: one ``[s/P, b, h]`` less).

The hooks see only the forward (the recompute in the backward saves its tensors on the device, as
it must).  Megatron's ``CheckpointFunction.backward`` also holds the recomputed region's output for
the whole of the region's backward, though the backward reads only its shape (a residual add saves
no output): with the offload on, :func:`release_recomputed_outputs` hands it the output's shape (a
zero-strided view of one element, :class:`ShapeOnly`) and the output's bytes go at once -- one
``[s/P, b, h]`` less in every layer's backward, which is where the step peaks.

Values are copied, never changed: the math is the run's without offload.  On a CPU the tensors
already live in host memory and nothing is copied (``copy_host=True`` copies them anyway, through
the same bookkeeping: the tests' exactness check).  ``host_bytes`` / ``peak_host_bytes``
count what sits on the host.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
from megatron.core import tensor_parallel


_NEXT: list = []  # (hooks, saved): the copy back that the next prefetch point starts (at most one)


def _start_next() -> None:
    while _NEXT:
        hooks, saved = _NEXT.pop()
        if saved.back is None and saved.host is not None:
            hooks._fetch(saved)


class _PrefetchPoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        _start_next()
        return grad


def prefetch_point(t: torch.Tensor) -> torch.Tensor:
    """``t``; where a copy back is pending (a recomputed region's backward is under way) and ``t`` takes
    a gradient, the copy starts once ``t``'s gradient is computed.  ``UlyssesAttention`` puts it on its
    query: the layer below's input comes back after the attention's backward, where a recomputed
    layer's backward peaks, overlapping the rest of the layer's backward.  A region without one
    fetches its tensors when it needs them."""
    if not _NEXT or not torch.is_grad_enabled() or not t.requires_grad:
        return t
    return _PrefetchPoint.apply(t)


def _new_stats() -> dict:
    return {"host_bytes": 0, "peak_host_bytes": 0, "tensors": 0}


class _Saved:
    """One offloaded tensor: its host copy, where it goes back, and its copy back once started."""

    __slots__ = ("host", "device", "event", "back", "previous")

    def __init__(self, host, device, event, previous):
        self.host, self.device, self.event, self.back, self.previous = host, device, event, None, previous


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of ``min_bytes`` or more to pinned host memory, each prefetched back for the
    backward while the one saved after it is in use.

    ``min_bytes``: smaller tensors stay where they are (masks, scalars); ``weights``: the storages of
    the model's parameters (``storage._cdata``), whose views stay too -- the model holds them anyway,
    so a host copy would free nothing; ``copy_host``: copy CPU tensors too (the tests: the
    bookkeeping without a GPU).  One instance per forward: its saves form one chain that the
    backward walks in reverse."""

    def __init__(
        self,
        min_bytes: int = 1 << 20,
        *,
        copy_host: bool = False,
        stats: Optional[dict] = None,
        weights: frozenset = frozenset(),
    ):
        self.min_bytes, self.copy_host, self.weights = min_bytes, copy_host, weights
        self.stats = stats if stats is not None else _new_stats()
        self.last: Optional[_Saved] = None
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        super().__init__(self._pack, self._unpack)

    def _eligible(self, t: torch.Tensor) -> bool:
        big = t.numel() * t.element_size() >= self.min_bytes
        where = t.is_cuda or (self.copy_host and t.device.type == "cpu")
        return big and where and t.untyped_storage()._cdata not in self.weights

    def _pack(self, t: torch.Tensor):
        if not self._eligible(t):
            return t
        event = None
        if t.is_cuda and self.stream is None:  # the dry run's fake CUDA: no streams, the bytes move all the same
            host = t.detach().to("cpu")
        elif t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            t.record_stream(self.stream)  # the device memory is free again once the copy has run
        else:
            host = t.detach().clone()
        self._count(host, +1)
        self.last = _Saved(host, t.device, event, self.last)
        return self.last

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.back is None:
            self._fetch(saved)
        out, saved.back = saved.back, None  # the node holds it now: freed when the node is done with it
        if saved.device.type == "cuda" and self.stream is not None:
            torch.cuda.current_stream(saved.device).wait_stream(self.stream)
        _NEXT.clear()  # the copy this region's prefetch point starts: the one the backward needs next
        if saved.previous is not None and saved.previous.back is None and saved.previous.host is not None:
            _NEXT.append((self, saved.previous))
        if saved.host is not None:
            self._count(saved.host, -1)
            saved.host = None
        return out

    def _fetch(self, saved: _Saved) -> None:
        if saved.device.type != "cuda":
            saved.back = saved.host.clone()
            return
        if self.stream is None:
            saved.back = saved.host.to(saved.device)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(saved.event)
            saved.back = saved.host.to(saved.device, non_blocking=True)

    def _count(self, host: torch.Tensor, sign: int) -> None:
        s = self.stats
        s["host_bytes"] += sign * host.numel() * host.element_size()
        s["peak_host_bytes"] = max(s["peak_host_bytes"], s["host_bytes"])
        s["tensors"] += max(sign, 0)


class ShapeOnly(torch.autograd.Function):
    """The identity on gradients whose output is its input's shape, dtype and device without its bytes
    (one zero expanded): a root for a backward that reads nothing of it."""

    @staticmethod
    def forward(ctx, out):
        return out.new_zeros(()).expand(out.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _roots_only(function):
    """``function`` as Megatron's ``CheckpointFunction`` runs it: its first call (the forward, no grad)
    returns what ``function`` returns; a second call with grad enabled (the recompute inside the
    backward, whose outputs only start the region's backward) returns each output that needs a
    gradient as a :class:`ShapeOnly`, so the output itself is not held."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        out = function(*args)
        if calls[0] == 1 or not torch.is_grad_enabled():
            return out
        if isinstance(out, torch.Tensor):
            return ShapeOnly.apply(out) if out.requires_grad else out
        return type(out)(ShapeOnly.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in out)

    return run


def release_recomputed_outputs() -> None:
    """Route ``megatron.core.tensor_parallel.checkpoint`` (what Megatron's full and selective recompute
    call, on megatron-core 0.16 and 0.19) through :func:`_roots_only`.  Values and gradients are
    unchanged.  Idempotent."""
    original = tensor_parallel.checkpoint
    if getattr(original, "_roots_only", False):
        return

    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        return original(_roots_only(function), distribute_saved_activations, *args)

    checkpoint._roots_only = True
    tensor_parallel.checkpoint = checkpoint


def checkpoint_min_bytes(seq_length: int, micro_batch_size: int, hidden_size: int, shards: int, bf16: bool) -> int:
    """Half a layer input's bytes on one rank (``seq_length / shards`` tokens of ``micro_batch_size``
    samples, ``hidden_size`` wide): what the flag moves is that large or larger."""
    return max(1, seq_length // shards * micro_batch_size * hidden_size * (2 if bf16 else 4) // 2)


def enable_activation_offload(
    model, *, min_bytes: int = 1 << 20, copy_host: Optional[bool] = None, stats: Optional[dict] = None
) -> dict:
    """Run ``model``'s forward (a built Megatron-Core ``GPTModel``) under :class:`HostOffload`, one
    chain per forward; returns the stats record the hooks keep (``host_bytes``, ``peak_host_bytes``,
    ``tensors``).  ``copy_host`` (default: when there is no GPU) makes a CPU run copy host to host
    through the same bookkeeping, so it checks the offload exactly.  ``stats``: another model's
    record to count in (a pipeline stage's chunks: one host peak).  Idempotent."""
    if getattr(model, "_offload_stats", None) is not None:
        return model._offload_stats
    release_recomputed_outputs()
    if copy_host is None:
        copy_host = not torch.cuda.is_available()
    stats = stats if stats is not None else _new_stats()
    forward = model.forward

    @functools.wraps(forward)
    def offloaded(*args, **kwargs):
        weights = frozenset(p.untyped_storage()._cdata for p in model.parameters())
        with HostOffload(min_bytes, copy_host=copy_host, stats=stats, weights=weights):
            return forward(*args, **kwargs)

    model.forward = offloaded
    model._offload_stats = stats
    return stats


__all__: List[str] = [
    "HostOffload",
    "ShapeOnly",
    "checkpoint_min_bytes",
    "enable_activation_offload",
    "prefetch_point",
    "release_recomputed_outputs",
]
