"""The kernel registry: a backend name (``sdpa``, ``flash``, ``te``) or a callable -> the kernel run
on the gathered sequence for this rank's heads.  Every kernel takes ``q [S, b, hq, d]`` (``sbhd``)
or ``[b, S, hq, d]`` (``bshd``) and ``k, v`` with ``hk`` heads (``hq % hk == 0``), Megatron's mask
convention (True = not allowed), and returns the output in the same layout; a callable that
declares ``heads`` gets the global query heads it holds, and ``window_size`` / ``softmax_offset``
/ ``return_lse`` when it declares them.  Nothing here knows about ranks.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from ..options import VARIANT_OPTIONS, backend_error, callable_accepts, callable_option_error, options_set
from .flash import flash_attention
from .sdpa import sdpa_attention
from .te import TEKernel

Kernel = Callable[..., torch.Tensor]


def resolve(backend: Union[str, Kernel]) -> Kernel:
    """The kernel for ``backend`` (call :func:`backend_error` first for a clean message); for ``"te"``
    a new :class:`~ulysses_mcore.kernels.te.TEKernel`, holding the modules it builds for the caller."""
    err = backend_error(backend)
    if err:
        raise ValueError(err)
    if callable(backend):
        user = backend

        def call_user(q, k, v, *, causal, softmax_scale=None, layout="sbhd", **kw):
            if any(kw.get(n) is not None for n in ("attention_mask", "attention_bias", "cu_seqlens")) or kw.get(
                "dropout_p"
            ):
                raise ValueError(
                    "a callable backend takes (q, k, v, *, causal, softmax_scale) only: "
                    "masks, bias and dropout need backend='sdpa' or 'te'"
                )
            extra = {}
            for name in options_set(*(kw.get(n) for n in VARIANT_OPTIONS)):
                if not callable_accepts(user, name):
                    raise ValueError(callable_option_error(name))
                extra[name] = kw[name]
            if kw.get("heads") is not None and callable_accepts(user, "heads"):
                extra["heads"] = kw["heads"]  # the global query heads this call holds
            return user(q, k, v, causal=causal, softmax_scale=softmax_scale, **extra)

        return call_user
    if backend == "te":
        return TEKernel()
    return {"sdpa": sdpa_attention, "flash": flash_attention}[backend]
