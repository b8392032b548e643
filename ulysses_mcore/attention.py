"""Ulysses attention: validate (once) -> all-to-all -> any attention kernel -> all-to-all.

:func:`ulysses_attention` is the framework-neutral functional form (torch only).  The
Megatron-Core ``core_attention`` module built on it is
:class:`ulysses_mcore.megatron.module.UlyssesAttention`.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import Kernel, has_window, resolve
from .exchange import HeadPlan, expand_kv, head_to_seq, pack_lse, seq_dim, seq_to_head, unpack_lse
from .validation import Validator

VALIDATOR = Validator()  # the functional API's verdicts, cached per group and call signature


def load_balanced_permutation(degree: int) -> List[int]:
    """Megatron's dual-chunk order: the sequence is cut into ``2P`` chunks and rank ``r``
    holds chunks ``r`` and ``2P-1-r``.  Entry ``p`` is the natural chunk at position ``p``
    of the rank-ordered (received) sequence: ``[0, 2P-1, 1, 2P-2, ...]``."""
    return [p // 2 if p % 2 == 0 else 2 * degree - 1 - p // 2 for p in range(2 * degree)]


def per_document_order(cu_seqlens: torch.Tensor, degree: int) -> torch.Tensor:
    """Transformer Engine's / Megatron's THD context-parallel layout: every document (length a
    multiple of ``2P``) is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and
    ``2P-1-r`` of each, documents in order.  Returns the natural position of each token of
    the concatenation of ranks ``0 .. P-1`` (what the all-to-all delivers).  Vectorised:
    it runs in every layer's forward, on streams of up to millions of tokens."""
    from .ring import document_ids

    cu = cu_seqlens.to(torch.long)
    total = int(cu[-1])
    pos = torch.arange(total)
    doc = document_ids(cu, total)
    start = cu[doc]
    chunk = (cu[1:] - cu[:-1])[doc] // (2 * degree)  # > 0: a token's document is not empty
    j, off = (pos - start) // chunk, (pos - start) % chunk
    owner = torch.minimum(j, 2 * degree - 1 - j)
    # within its owner, a token sits after the earlier documents' 2 chunks each (start / P),
    # in the document's first or second chunk
    received = owner * (total // degree) + start // degree + (j >= degree) * chunk + off
    order = torch.empty_like(pos)
    order[received] = pos
    return order


def _reorder_chunks(t: torch.Tensor, index: List[int], sd: int) -> torch.Tensor:
    """Chunks of the sequence dim in the order ``index`` (a permutation of ``2P`` chunks)."""
    n = len(index)
    chunks = t.unflatten(sd, (n, t.shape[sd] // n))
    return torch.cat([chunks.select(sd, i) for i in index], dim=sd)


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
    check: bool = True,
    token_order: str = "contiguous",
    overlap_chunks: int = 1,
    ring_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqlens: Optional[torch.Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    first_head: int = 0,
    validator: Optional[Validator] = None,
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
    rank instead of hanging a collective; the verdict is cached (``validator``, default one per
    process), so later calls validate nothing.  ``check=False`` skips it.

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
    get zero output.

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
    degree = 1 if group is None else dist.get_world_size(group)
    ring = 1 if ring_group is None else dist.get_world_size(ring_group)
    if degree < 1 or ring < 1:  # no peer waits on a rank outside the group: raising here is safe
        raise ValueError(f"ulysses_attention: rank {dist.get_rank()} is not a member of the "
                         f"{'group' if degree < 1 else 'ring_group'} it was given; pass this rank's own group")
    if check:
        (validator or VALIDATOR).check(
            query, key, value, group=group, ring_group=ring_group, degree=degree, ring=ring, layout=layout,
            backend=backend, causal=causal, softmax_scale=softmax_scale, attention_mask=attention_mask,
            attention_bias=attention_bias, dropout_p=dropout_p, token_order=token_order,
            overlap_chunks=overlap_chunks, cu_seqlens=cu_seqlens, seqlens=seqlens, window_size=window_size,
            softmax_offset=softmax_offset, return_lse=return_lse)
    thd = layout == "thd"
    if thd:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        layout = "sbhd"
    kw = dict(causal=causal, softmax_scale=softmax_scale, layout=layout)
    for name, val in (("attention_mask", attention_mask), ("attention_bias", attention_bias),
                      ("cu_seqlens", cu_seqlens), ("seqlens", seqlens)):
        if val is not None:
            kw[name] = val
    if dropout_p:
        kw["dropout_p"] = dropout_p
    if has_window(window_size):
        kw["window_size"] = tuple(window_size)
    if return_lse:
        kw["return_lse"] = True
    kernel = _ring_kernel(backend, ring_group, token_order) if ring > 1 else resolve(backend)
    if degree == 1:
        kw["heads"] = (first_head, first_head + query.shape[2])
        if softmax_offset is not None:
            kw["softmax_offset"] = softmax_offset
        out = kernel(query, key, value, **kw)
    else:
        out = _exchange_and_attend(query, key, value, group, degree, layout, kernel, kw, token_order,
                                   overlap_chunks, cu_seqlens, softmax_offset, first_head)
    if thd:
        return (out[0].squeeze(1), out[1].squeeze(1)) if return_lse else out.squeeze(1)
    return out


def _exchange_and_attend(query, key, value, group, degree, layout, kernel, kw, token_order, chunks, cu,
                         offset, first):
    rank = dist.get_rank(group)
    plan = HeadPlan(query.shape[2], key.shape[2], degree)
    to_natural, to_received = _token_orders(token_order, degree, cu, query.device, seq_dim(layout))

    def run_kernel(q, k, v, first_head, num_heads):
        kwc = dict(kw, heads=(first + first_head, first + first_head + num_heads))
        for name in ("attention_mask", "attention_bias"):
            t = kwc.get(name)
            if t is not None and t.shape[1] != 1:
                kwc[name] = t[:, first_head:first_head + num_heads]
        if offset is not None:  # this rank's heads' sinks: autograd routes their gradient back
            kwc["softmax_offset"] = offset[first_head:first_head + num_heads]
        q, k, v = (to_natural(t) for t in (q, k, v))
        res = kernel(q, k, v, **kwc)
        if kw.get("return_lse"):
            return to_received(res[0]), to_received(res[1])
        return to_received(res)

    if chunks > 1:
        from .overlap import OverlappedUlysses

        qc = plan.q_count(rank) // chunks
        return OverlappedUlysses.apply(
            query, key, value, group, plan, layout, chunks,
            lambda q, k, v, c: run_kernel(q, k, v, plan.q_range(rank)[0] + c * qc, qc))
    q, k, v = seq_to_head(query, key, value, group, plan, layout, rank)
    k, v = expand_kv(k, plan, rank), expand_kv(v, plan, rank)
    lo, hi = plan.q_range(rank)
    out = run_kernel(q, k, v, lo, hi - lo)
    if kw.get("return_lse"):  # the lse rides in the output's all-to-all, bit-cast into extra columns
        out, lse = out
        dv = out.shape[-1]
        return unpack_lse(head_to_seq(pack_lse(out, lse), group, plan, layout, rank), dv, lse.dtype)
    return head_to_seq(out, group, plan, layout, rank)


def _token_orders(token_order, degree, cu, device, sd):
    """(received -> natural, natural -> received) reorderings of the gathered sequence."""
    if token_order == "load_balanced":
        perm = load_balanced_permutation(degree)
        inv = sorted(range(len(perm)), key=perm.__getitem__)
        return (lambda t: _reorder_chunks(t, inv, sd)), (lambda t: _reorder_chunks(t, perm, sd))
    if token_order == "per_document":
        order = per_document_order(cu, degree).to(device)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=device)
        return (lambda t: t.index_select(sd, inv)), (lambda t: t.index_select(sd, order))
    same = lambda t: t  # noqa: E731
    return same, same


def new_sequence_groups(ulysses: int, cp: int = 1):
    """``(ulysses_group, ring_group)`` of this rank for the functional API, without Megatron:
    the world cut into Ulysses groups of ``ulysses`` contiguous ranks and ring groups of
    ``cp`` ranks at stride ``ulysses`` (the layout :func:`ulysses_mcore.initialize` gives
    Megatron), so rank ``u + ulysses*j`` holds sequence shard ``u + ulysses*j``.  ``None``
    for an axis of size 1.  Every rank must call it (it creates process groups).  Raises
    ``ValueError`` on every rank alike, before creating any group, when the sizes do not fit."""
    from .topology import Topology, TopologyError

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


def _ring_kernel(backend, ring_group, token_order: str) -> Kernel:
    """The inner kernel when a ring follows the all-to-all: this rank's ring shard in, out."""
    if backend == "te":
        from .backends import te_attention

        def te_ring(q, k, v, **kw):
            return te_attention(q, k, v, ring_group=ring_group, **kw)

        return te_ring
    from .ring import ring_attention

    def lse_ring(q, k, v, *, causal, softmax_scale=None, layout="sbhd", attention_mask=None,
                 attention_bias=None, cu_seqlens=None, seqlens=None, window_size=None, softmax_offset=None,
                 return_lse=False, heads=None):
        return ring_attention(q, k, v, group=ring_group, causal=causal, softmax_scale=softmax_scale,
                              layout=layout, token_order=token_order, attention_mask=attention_mask,
                              attention_bias=attention_bias, cu_seqlens=cu_seqlens, window_size=window_size,
                              softmax_offset=softmax_offset, return_lse=return_lse)

    return lse_ring
