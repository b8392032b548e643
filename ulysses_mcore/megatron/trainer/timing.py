"""Where a training step's time goes, measured inside the step (the trainer's ``--timing``).

Phases, per rank and iteration, in seconds:

* ``a2a``: the Ulysses all-to-alls (every ``all_to_all_single`` on the Ulysses group), forward
  and backward, with the bytes this rank sent;
* ``ring``: the ring's shifts on the ring group (sent bytes too);
* ``attention``: the attention kernel -- the time inside ``UlyssesAttention`` (forward, and
  backward from the gradient of its output to the gradients of q, k, v) less the all-to-alls
  and ring shifts inside it;
* ``mlp``: the MLP modules, forward and backward;
* ``optimizer``: the optimizer step (gradient clipping and the update);
* ``cpu``: the process's CPU time in the iteration (its busy time on a CPU, waits excluded), and
  ``peak_gb``: the peak memory so far (CUDA's allocated peak, else the process's resident peak).

Nothing in the package's hot path knows about it: the collectives are observed by wrapping
``torch.distributed.all_to_all_single`` while a :class:`StepTimer` is installed, modules by
forward hooks and tensor gradient hooks (a module's backward runs from its output's gradient
to its inputs' gradients), the optimizer by wrapping its ``step`` on the instance.  On a GPU
every mark synchronises the device, which slows the step a little: time with ``--timing``,
compare throughput without it.
"""

from __future__ import annotations

import resource
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP

from ulysses_mcore.megatron.layer.module import UlyssesAttention

PHASES = ("a2a", "ring", "attention", "mlp", "optimizer")


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_gb() -> float:
    """The peak memory so far, GB: CUDA's allocated peak when CUDA is in use, else the process's resident peak."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class StepTimer:
    """Phase times and bytes of the current iteration; :meth:`take` returns and resets them."""

    def __init__(self, ulysses_group=None, ring_group=None):
        """``ulysses_group``: a group, or a list of them (``--dynamic-ulysses``: every degree's)."""
        a2a = list(ulysses_group) if isinstance(ulysses_group, (list, tuple)) else [ulysses_group]
        self.groups = [("a2a", g) for g in a2a] + [("ring", ring_group)]
        self._cpu = time.process_time()
        self.times: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.bytes: Dict[str, int] = {"a2a": 0, "ring": 0}
        self._inside_attention = 0.0  # collective time spent inside an attention module, to subtract
        self._handles: List = []
        self._kinds: Dict[int, object] = {}
        self._saved = None

    # ---------------------------------------------------------------- install / remove
    def install(self, model, optimizer) -> StepTimer:
        self._saved = dist.all_to_all_single
        dist.all_to_all_single = self._collective

        for module in model.modules():
            if isinstance(module, UlyssesAttention):
                self._time_module(module, "attention")
            elif isinstance(module, MLP):  # the sequence-tiled MLP too (a subclass)
                self._time_module(module, "mlp")
        step = optimizer.step

        def timed_step(*a, **kw):
            t = _now()
            try:
                return step(*a, **kw)
            finally:
                self.times["optimizer"] += _now() - t

        optimizer.step = timed_step
        self._optimizer = optimizer
        return self

    def remove(self) -> None:
        if self._saved is not None:
            dist.all_to_all_single = self._saved
            self._saved = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if getattr(self, "_optimizer", None) is not None:
            self._optimizer.__dict__.pop("step", None)
            self._optimizer = None

    def take(self) -> dict:
        """This iteration's phase times (s) and bytes sent, then zeros for the next."""
        out = {**{f"{k}_s": v for k, v in self.times.items()}, **{f"{k}_bytes": v for k, v in self.bytes.items()}}
        cpu, self._cpu = self._cpu, time.process_time()
        out["cpu_s"], out["peak_gb"] = self._cpu - cpu, peak_gb()
        self.times = dict.fromkeys(PHASES, 0.0)
        self.bytes = {"a2a": 0, "ring": 0}
        return out

    # ---------------------------------------------------------------- observers
    def _kind(self, group):
        """ "a2a", "ring" or None: the group by its ranks (Megatron's pg_collection may hand the module
        other group objects over the same ranks than the trainer's)."""
        key = id(group)
        if key not in self._kinds:
            self._kinds[key] = None
            for kind, g in self.groups:
                try:
                    same = g is group or (
                        group is not None
                        and g is not None
                        and dist.get_process_group_ranks(group) == dist.get_process_group_ranks(g)
                    )
                except (ValueError, RuntimeError, KeyError):  # a group of another world (threaded tests)
                    same = False
                if same:
                    self._kinds[key] = kind
        return self._kinds[key]

    def _collective(self, output, input, *a, **kw):
        group = kw.get("group")
        kind = self._kind(group)
        if kind is None:
            return self._saved(output, input, *a, **kw)
        t = _now()
        work = self._saved(output, input, *a, **kw)
        if work is not None and kw.get("async_op"):
            work.wait()  # timed to completion (the ring overlaps it with compute otherwise)
        dt = _now() - t
        self.times[kind] += dt
        self._inside_attention += dt
        size = dist.get_world_size(group)
        self.bytes[kind] += input.numel() * input.element_size() * (size - 1) // size
        return work

    def _time_module(self, module, phase: str) -> None:
        def pre(mod, args):
            mod._timing_start = (_now(), self._inside_attention)
            if torch.is_grad_enabled():
                for t in args:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._backward_end(mod, phase))

        def post(mod, args, out):
            t0, inside0 = mod._timing_start
            self._add(phase, _now() - t0, self._inside_attention - inside0)
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(self._backward_start(mod))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _backward_start(self, mod):
        def hook(grad):
            mod._timing_back = (_now(), self._inside_attention)

        return hook

    def _backward_end(self, mod, phase):
        def hook(grad):
            start = getattr(mod, "_timing_back", None)
            if start is not None:  # the first input gradient ends the module's backward
                mod._timing_back = None
                self._add(phase, _now() - start[0], self._inside_attention - start[1])

        return hook

    def _add(self, phase, elapsed, collectives_inside):
        self.times[phase] += max(0.0, elapsed - (collectives_inside if phase == "attention" else 0.0))
