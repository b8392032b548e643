"""Ulysses attention: validate (once) -> all-to-all -> any attention kernel -> all-to-all.

:func:`ulysses_attention` is the framework-neutral functional form (torch only): its keywords,
as one tuple, key the prepared call of the signature (:mod:`ulysses_mcore.call`); the call site
(:class:`~ulysses_mcore.options.CallSite`) is built when a signature is first prepared.  The Megatron-Core
``core_attention`` module built on it is :class:`ulysses_mcore.megatron.layer.module.UlyssesAttention`.
"""

from __future__ import annotations

import atexit
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .call import LIVE_CACHES, CallCache
from .call import release as release_caches
from .exchange.orders import load_balanced_permutation, per_document_order  # noqa: F401 - public here too
from .kernels.registry import Kernel
from .options import NO_TENSORS, CallSite, CallTensors, call_site
from .topology import Topology, TopologyError

# what a functional call chooses, in the order of the tuple that keys its prepared calls
_CHOICES = ("causal", "layout", "backend", "softmax_scale", "dropout_p", "token_order", "overlap_chunks")
_CHOICES += ("window_size", "return_lse", "group", "ring_group", "first_head", "check")


def _site(choices: tuple) -> CallSite:
    """The call site of a functional call's choices (built when its first signature is prepared)."""
    c = dict(zip(_CHOICES, choices))
    return call_site(c.pop("causal"), **c)


CALLS = CallCache(_site)  # the functional API's prepared calls (a UlyssesAttention module keeps its own)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group,
    causal: bool,
    layout: str = "sbhd",
    backend: Union[str, Kernel] = "sdpa",
    softmax_scale: Optional[float] = None,
    attention_mask: Optional[torch.Tensor] = None,
    attention_bias: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    check: Union[bool, str] = True,
    token_order: str = "contiguous",
    overlap_chunks: int = 1,
    ring_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqlens: Optional[torch.Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    first_head: int = 0,
    max_seqlen: Optional[int] = None,
):
    """Exact attention over a sequence whose tokens are sharded contiguously over ``group`` (size P).

    Arguments:
        query: (s/P, b, hq, d) for ``layout="sbhd"``, (b, s/P, hq, d) for ``"bshd"``, (t/P, hq, d) for
            ``"thd"``: this rank's tokens; fp32, bf16, fp16 or fp64.
        key, value: the same with hk heads (hq % hk == 0); ``value`` may have another head dim dv.
        group: the Ulysses process group (``None`` or size 1: the kernel alone).
        causal: bool.  layout: "sbhd" | "bshd" | "thd".  backend: "sdpa" | "flash" | "te" | a callable.
        softmax_scale: float, default 1/sqrt(d).  dropout_p: float.
        attention_mask: bool (b|1, hq|1, s|1, s), True = masked, over the whole sequence.
        attention_bias: additive, the mask's shape and the query's dtype.
        check: True (the first call of a signature is validated on every rank) | False |
            "every_call" (every call agrees with its group first: one all-reduce).
        token_order: "contiguous" | "load_balanced" (Megatron's dual chunks) | "per_document" (THD).
        overlap_chunks: int, head chunks whose all-to-alls overlap the others' attention.
        ring_group: the ring's process group (size C) of the hybrid Ulysses x ring.
        cu_seqlens: int32 (n+1,), the global document boundaries (``"thd"``), the same on every rank.
        seqlens: int32 (n,), real document lengths inside padded slots.  max_seqlen: host int bound.
        window_size: (left, right), -1 unbounded.  softmax_offset: (hq,), one sink logit per head.
        return_lse: bool.  first_head: int, the model's index of ``query``'s head 0.
    Return:
        out: this rank's tokens in the input's layout, head dim dv; with ``return_lse`` also
            lse: float32 (s/P, b, hq) (float64 for fp64 inputs), differentiable.

    Forward: two ``all_to_all_single``, backward two (a ring adds C-1 and 2C-1 shifts).  Bad input
    raises the same ``ValueError`` on every rank before any data collective.  In detail: docs/api.md.
    """
    if type(window_size) is list:
        window_size = tuple(window_size)
    choices = (causal, layout, backend, softmax_scale, dropout_p, token_order, overlap_chunks, window_size)
    choices += (return_lse, group, ring_group, first_head, check)
    tensors = NO_TENSORS
    if (
        attention_mask is not None
        or attention_bias is not None
        or cu_seqlens is not None
        or seqlens is not None
        or softmax_offset is not None
    ):
        tensors = CallTensors(
            attention_mask=attention_mask,
            attention_bias=attention_bias,
            cu_seqlens=cu_seqlens,
            seqlens=seqlens,
            softmax_offset=softmax_offset,
            max_seqlen=max_seqlen,
        )
    return CALLS.run(query, key, value, choices, tensors)


def release() -> None:
    """Drop what the package holds between calls in this process, to free its memory: the
    functional API's prepared calls (with the process groups and Transformer Engine modules they
    hold), the exchange's CPU buffers (this thread's) and the host copies of document boundaries.
    ``UlyssesAttention`` modules hold their own prepared calls: they go with the model.  Not needed
    for a clean exit: at exit the package lets go of every group it holds by itself
    (:func:`_let_go_at_exit`)."""
    release_caches([CALLS])


@atexit.register
def _let_go_at_exit() -> None:
    """At interpreter exit, while Python is still whole: every prepared call of every cache (the
    modules' too) lets go of the process groups it holds, so none is destroyed during finalization
    (where gloo aborts the process: docs/design.md, "No abort at exit")."""
    release_caches(LIVE_CACHES)


def new_sequence_groups(ulysses: int, cp: int = 1):
    """``(ulysses_group, ring_group)`` of this rank for the functional API, without Megatron:
    the world cut into Ulysses groups of ``ulysses`` contiguous ranks and ring groups of
    ``cp`` ranks at stride ``ulysses`` (the layout :func:`ulysses_mcore.initialize` gives
    Megatron), so rank ``u + ulysses*j`` holds sequence shard ``u + ulysses*j``.  ``None``
    for an axis of size 1.  Every rank must call it (it creates process groups).  Raises
    ``ValueError`` on every rank alike, before creating any group, when the sizes do not fit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        topo = Topology(world, ulysses=ulysses, cp=cp)
    except TopologyError as e:
        raise ValueError(f"new_sequence_groups(ulysses={ulysses}, cp={cp}): {e}") from None
    mine = {}
    for axis, size in (("ulysses", ulysses), ("cp", cp)):
        for ranks in topo.groups(axis):
            g = dist.new_group(ranks) if size > 1 else None
            if rank in ranks:
                mine[axis] = g
    return mine["ulysses"], mine["cp"]
