"""Ulysses attention: validate (once) -> all-to-all -> any attention kernel -> all-to-all.

:func:`ulysses_attention` is the framework-neutral functional form (torch only): it turns its
keywords into one :class:`~ulysses_mcore.options.AttentionOptions` record (a dict lookup) and
runs the prepared call of the signature (:mod:`ulysses_mcore.call`).  The Megatron-Core
``core_attention`` module built on it is :class:`ulysses_mcore.megatron.layer.module.UlyssesAttention`.
"""

from __future__ import annotations

import atexit
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import Kernel
from .call import LIVE_CACHES, CallCache
from .options import NO_TENSORS, CallSite, CallTensors, attention_options
from .orders import host_bounds, host_lengths, load_balanced_permutation, per_document_order  # noqa: F401 - public here too
from .te import _TE_CACHE
from .topology import Topology, TopologyError
from .transport import POOL

CALLS = CallCache()  # the functional API's prepared calls (a UlyssesAttention module keeps its own)


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
    """Exact attention over a sequence whose tokens are sharded contiguously over ``group``.

    Rank ``r`` of ``group`` (size ``P``) holds tokens ``r*s/P ... (r+1)*s/P - 1`` of every
    sequence: ``query [s/P, b, hq, d]`` and ``key``/``value [s/P, b, hk, d]`` for
    ``layout="sbhd"`` (``[b, s/P, h, d]`` for ``"bshd"``).  Returns this rank's output
    shard in the same layout.  Differentiable (once: double backward is refused).

    ``attention_mask`` (bool, True = masked, Megatron's convention) and ``attention_bias``
    (additive) cover the *full* sequence: ``[b or 1, hq or 1, s, s]``.

    ``check=True`` (default): the first call of each signature (shapes, dtypes, flags) exchanges
    a typed record of every rank's inputs, so a bad input raises the same ``ValueError`` on every
    rank instead of hanging a collective; the call is then prepared once (:mod:`ulysses_mcore.call`),
    so later calls validate nothing and recompute nothing.  ``check=False`` skips the exchange.
    ``check="every_call"`` (shapes or documents that change from call to call): also, every call
    first agrees with its group on its signature, its document boundaries and whether any rank meets
    it for the first time (one all-reduce of five integers), so ranks whose calls differ raise the
    same ``ValueError`` instead of entering an all-to-all of mismatched sizes.  The default trusts
    the boundaries of a later packed micro-batch (only the first of a signature is compared).
    ``check`` and whether a backward runs must be the same on every rank of the group: a rank with
    ``check=False`` beside ranks that check, or a rank that skips the backward its peers run, leaves
    the others waiting in a collective until the process group's timeout.

    ``token_order="load_balanced"``: Megatron's context-parallel (dual-chunk) shard -- rank ``r``
    holds chunks ``r`` and ``2P-1-r`` of ``2P``; masks still cover the sequence in natural order.
    ``"per_document"`` (packed input): Transformer Engine's / Megatron-LM's THD layout, every
    document padded to a multiple of ``2P`` and dealt out in dual chunks (:func:`per_document_order`).

    ``overlap_chunks=C > 1`` pipelines ``C`` head chunks' asynchronous all-to-alls with the other
    chunks' attention (:mod:`ulysses_mcore.overlap`); ``2C`` all-to-alls each way.

    ``ring_group`` (size ``C > 1``): hybrid Ulysses x ring; rank ``u`` of ``group`` and ``j`` of
    ``ring_group`` hold shard ``u + P*j`` (Megatron's hierarchical context parallelism, Ulysses
    inner); ring attention (:mod:`ulysses_mcore.ring`, or TE's p2p ring with ``backend="te"``)
    covers the other ring shards.

    ``layout="thd"``: ``query [t/P, hq, d]``, a packed stream split evenly, with ``cu_seqlens``
    (int ``[n+1]``, the *global* document boundaries, identical on every rank); attention never
    crosses a document.  ``seqlens`` (int ``[n]``): real document lengths when every document
    sits in a longer padded slot ``cu_seqlens[i] .. cu_seqlens[i+1]`` (Megatron/TE's
    ``cu_seqlens_q`` vs ``cu_seqlens_q_padded``); pad tokens are neither queries nor keys and
    get zero output.  ``max_seqlen`` (a host int, Megatron's ``PackedSeqParams.max_seqlen_q``):
    the longest document, or a bound on it, for the varlen kernels; without it they read it off
    ``cu_seqlens`` (a device-to-host sync per call on a GPU).  A new batch's boundaries are not
    a new signature: the first packed batch of a signature is validated, later ones are trusted.

    ``value`` may have another head dim than ``query``/``key`` (multi-latent attention, e.g. 192
    vs 128): the output has the value's.  ``attention_mask`` / ``attention_bias`` may broadcast
    over batch, heads and query rows (``[1, 1, 1, s]``, ``[b, 1, 1, s]``): never expanded.

    ``window_size=(left, right)``: sliding-window attention as Megatron, Transformer Engine and
    flash-attn define it (query ``i`` sees keys ``i-left .. i+right``, -1 unbounded; with
    ``causal`` the right reach is 0).  ``softmax_offset [hq]``: attention sinks, one logit per
    query head (of the heads in ``query``; zeros = "off-by-one", a parameter = "learnable"),
    differentiable; each rank's gradient covers its own queries (sum over the group, as
    Megatron's DDP does for replicated weights).  Kernels are told which global heads they hold:
    ``heads=(first_head + lo, first_head + hi)`` (``first_head``: index of ``query``'s head 0 in
    the model, e.g. the tensor-parallel rank x heads per rank).  ``return_lse=True``: returns
    ``(out, lse)``, the log-sum-exp of every query row in the output's layout without the last dim
    (``[s/P, b, hq]`` for ``sbhd``), float32 (float64 for float64 inputs), differentiable; it
    travels in the output's all-to-all (bit-cast into extra columns), so still one collective.

    Collectives in steady state: forward 2 all_to_all_single, backward 2; a ring adds ``C-1``
    shifts forward and ``2C-1`` backward.  ``group=None`` or a group of size 1 runs the kernel
    directly.
    """
    opts = attention_options(
        causal,
        layout=layout,
        backend=backend,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        token_order=token_order,
        overlap_chunks=overlap_chunks,
        window_size=window_size,
        return_lse=return_lse,
    )
    site = CallSite(opts, group=group, ring_group=ring_group, first_head=first_head, check=check)
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
    return CALLS.run(query, key, value, site, tensors)


def release() -> None:
    """Drop what the package holds between calls in this process, to free its memory: the
    functional API's prepared calls (and the process groups they reference), Transformer Engine
    modules cached for it, the exchange's CPU buffers (this thread's) and the host copies of
    document boundaries.  ``UlyssesAttention`` modules hold their own prepared calls: they go with
    the model.  Not needed for a clean exit: at exit the package lets go of every group it holds
    by itself (:func:`_let_go_at_exit`)."""
    CALLS.clear()
    _TE_CACHE.clear()
    POOL.clear()
    host_bounds.clear()
    host_lengths.clear()


@atexit.register
def _let_go_at_exit() -> None:
    """At interpreter exit, while Python is still whole: every prepared call of every cache (the
    modules' too) let go of the process groups they hold.  A group object kept
    alive into interpreter finalization is destroyed there, after the runtime it needs is gone, and
    gloo's destructor then ends the process with ``terminate called without an active exception``
    (SIGABRT): 2 of 12, then 11 of 30 two-rank worlds without this hook, 0 of 100 with it
    (tests/test_attention.py, docs/design.md)."""
    release()
    for cache in list(LIVE_CACHES):
        cache.clear()


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
