"""Ulysses attention: all-to-all -> any ordinary attention kernel -> all-to-all.

:func:`ulysses_attention` is the functional form; :class:`UlyssesAttention` is a
Megatron-Core ``core_attention`` module with Megatron's builder keywords and forward
signature, to be put into a layer spec in place of ``DotProductAttention`` /
``TEDotProductAttention``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from . import checks, state
from .backends import Kernel, resolve
from .comm import HeadPlan, head_layout_error, head_to_seq, is_even, seq_to_head


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


def _reorder_chunks(t: torch.Tensor, index: List[int], seq_dim: int) -> torch.Tensor:
    n = len(index)
    idx = torch.tensor(index, device=t.device)
    return t.unflatten(seq_dim, (n, t.shape[seq_dim] // n)).index_select(seq_dim, idx).flatten(seq_dim, seq_dim + 1)


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
) -> torch.Tensor:
    """Exact attention over a sequence whose tokens are sharded contiguously over ``group``.

    Rank ``r`` of ``group`` (size ``P``) holds tokens ``r*s/P ... (r+1)*s/P - 1`` of every
    sequence: ``query [s/P, b, hq, d]`` and ``key``/``value [s/P, b, hk, d]`` for
    ``layout="sbhd"`` (``[b, s/P, h, d]`` for ``"bshd"``).  Returns this rank's output
    shard ``[s/P, b, hq, d]`` (same layout).  Differentiable.

    ``attention_mask`` (bool, True = masked, Megatron's convention) and ``attention_bias``
    (additive) cover the *full* sequence: ``[b or 1, hq or 1, s, s]``.

    With ``check=True`` (default) the ranks first all-gather a few integers describing
    their inputs, so a bad input raises the same ``ValueError`` on every rank instead of
    hanging a collective.  ``check=False`` skips that (validation is then local only).

    ``token_order="load_balanced"`` takes Megatron's context-parallel (dual-chunk) shard
    instead: rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P`` equal chunks; masks
    still cover the full sequence in natural order.

    ``overlap_chunks=C > 1`` cuts this rank's heads into ``C`` chunks and pipelines each
    chunk's (asynchronous) all-to-alls with the other chunks' attention, forward and
    backward (:mod:`ulysses_mcore.overlap`); ``2C`` all-to-alls each way.

    ``ring_group`` (size ``C > 1``): hybrid Ulysses x ring.  The sequence is sharded over
    the ``P x C`` ranks (rank ``u`` of ``group`` and ``j`` of ``ring_group`` hold shard
    ``u + P*j`` -- Megatron's hierarchical context parallelism, Ulysses inner); after the
    all-to-all each rank holds ring shard ``j`` for its heads and ring attention
    (:mod:`ulysses_mcore.ring`, or Transformer Engine's p2p ring with ``backend="te"``)
    covers the rest.  ``token_order`` is then over the ``2PC`` (or ``PC``) chunks.

    ``token_order="per_document"`` (packed input only): Transformer Engine's / Megatron-LM's
    THD context-parallel layout -- every document padded to a multiple of ``2P`` and dealt
    out in dual chunks (:func:`per_document_order`); ``cu_seqlens`` are then the padded
    boundaries.

    ``layout="thd"`` with ``cu_seqlens`` (int ``[n+1]``, the *global* document boundaries
    of the packed stream, identical on every rank): ``query [t/P, hq, d]``, the packed
    stream split evenly (documents may cross shard boundaries).  After the all-to-all the
    global ``cu_seqlens`` apply; attention never crosses a document.

    Collectives: forward 2 all_to_all_single (+1 tiny all_gather when ``check``; +1 more
    with a ring), backward 2 all_to_all_single; a ring adds ``C-1`` shifts forward and
    ``2C-1`` backward.  ``group=None`` or a group of size 1 runs the kernel directly.
    """
    degree = 1 if group is None else dist.get_world_size(group)
    ring = 1 if ring_group is None else dist.get_world_size(ring_group)
    thd = layout == "thd"
    if thd:
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                f"layout='thd' takes 3-D [t, h, d] query/key/value; got {query.dim()}-D, {key.dim()}-D, "
                f"{value.dim()}-D (for [s, b, h, d] use layout='sbhd')"
            )
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        layout = "sbhd"
    vec = checks.describe(
        query, key, value, layout=layout, backend=backend, causal=causal,
        attention_mask=attention_mask, attention_bias=attention_bias, token_order=token_order,
        overlap_chunks=overlap_chunks, ring=ring, dropout=dropout_p > 0,
        bias_grad=attention_bias is not None and attention_bias.requires_grad,
        cu_seqlens=cu_seqlens, thd=thd,
    )
    vectors = [vec] * (degree * ring)
    if check and degree > 1:
        vectors = checks.gather(vec, group)
    if check and ring > 1:  # every rank of the sample group sees every vector: same verdict everywhere
        vectors = [v for block in checks.gather(sum(vectors, []), ring_group) for v in checks.split(block, degree)]
    problem = checks.find_problem(vectors, degree=degree, ring=ring)
    if problem:
        raise ValueError(f"ulysses_attention: {problem}")
    kernel = resolve(backend)
    kw = dict(causal=causal, softmax_scale=softmax_scale, layout=layout)
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    if attention_bias is not None:
        kw["attention_bias"] = attention_bias
    if dropout_p:
        kw["dropout_p"] = dropout_p
    if cu_seqlens is not None:
        kw["cu_seqlens"] = cu_seqlens
    if ring > 1:
        kernel = _ring_kernel(backend, ring_group, token_order)

    def finish(out):
        return out.squeeze(1) if thd else out

    if degree == 1:
        return finish(kernel(query, key, value, **kw))

    rank = dist.get_rank(group)
    seq_dim = 0 if layout == "sbhd" else 1
    perm = load_balanced_permutation(degree) if token_order == "load_balanced" else None
    inv = sorted(range(len(perm)), key=perm.__getitem__) if perm else None
    doc_order = None
    if token_order == "per_document":  # received position -> natural position, and back
        doc_order = per_document_order(cu_seqlens, degree).to(query.device)
        doc_inv = torch.empty_like(doc_order)
        doc_inv[doc_order] = torch.arange(doc_order.numel(), device=doc_order.device)

    def run_kernel(q, k, v, first_head, num_heads):
        kwc = dict(kw)
        for name in ("attention_mask", "attention_bias"):
            t = kwc.get(name)
            if t is not None and t.shape[1] != 1:
                kwc[name] = t[:, first_head : first_head + num_heads]
        if perm:
            q, k, v = (_reorder_chunks(t, inv, seq_dim) for t in (q, k, v))  # received -> natural
        elif doc_order is not None:
            q, k, v = (t.index_select(seq_dim, doc_inv) for t in (q, k, v))
        out = kernel(q, k, v, **kwc)
        if perm:
            out = _reorder_chunks(out, perm, seq_dim)  # natural -> chunks by destination rank
        elif doc_order is not None:
            out = out.index_select(seq_dim, doc_order)
        return out

    if not is_even(query.shape[2], key.shape[2], degree):
        from .uneven import UnevenHeadToSeq, UnevenPlan, UnevenSeqToHead, expand_kv

        uplan = UnevenPlan(query.shape[2], key.shape[2], degree)
        q, k, v = UnevenSeqToHead.apply(query, key, value, group, uplan, layout)
        k, v = expand_kv(k, uplan, rank), expand_kv(v, uplan, rank)  # one kv head per query head
        lo, hi = uplan.q_range(rank)
        out = run_kernel(q, k, v, lo, hi - lo)
        return finish(UnevenHeadToSeq.apply(out, group, uplan, layout))
    plan = HeadPlan(query.shape[2], key.shape[2], degree)
    if overlap_chunks > 1:
        from .overlap import OverlappedUlysses

        qc = plan.q_per_rank // overlap_chunks
        return finish(OverlappedUlysses.apply(
            query, key, value, group, plan, layout, overlap_chunks,
            lambda q, k, v, c: run_kernel(q, k, v, rank * plan.q_per_rank + c * qc, qc),
        ))
    q, k, v = seq_to_head(query, key, value, group, plan, layout)
    out = run_kernel(q, k, v, rank * plan.q_per_rank, plan.q_per_rank)
    return finish(head_to_seq(out, group, degree, layout))


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
                 attention_bias=None, cu_seqlens=None):
        return ring_attention(q, k, v, group=ring_group, causal=causal, softmax_scale=softmax_scale,
                              layout=layout, token_order=token_order, attention_mask=attention_mask,
                              attention_bias=attention_bias, cu_seqlens=cu_seqlens)

    return lse_ring


# ----------------------------------------------------------------------------------
# Megatron-Core core_attention module
# ----------------------------------------------------------------------------------
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402


class UlyssesAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron-Core's ``SelfAttention``.

    Builder keywords are Megatron's (``config, layer_number, attn_mask_type,
    attention_type, attention_dropout, softmax_scale, cp_comm_type, pg_collection``) plus
    ``ulysses_group`` (default: the group registered by :func:`ulysses_mcore.initialize`)
    and ``backend`` (``"sdpa"``, ``"flash"``, ``"te"`` or a callable).

    Forward takes Megatron's ``query [s/P, b, hq, d]``, ``key``/``value [s/P, b, hk, d]``
    for the local token shard and returns ``[s/P, b, hq*d]``.  ``attn_mask_type`` causal
    ignores ``attention_mask`` (as Transformer Engine does); padding / arbitrary masks must
    cover the full sequence ``[b or 1, 1 or heads, s, s]`` (True = masked).

    With ``config.context_parallel_size = ulysses x cp`` (groups from
    :func:`ulysses_mcore.initialize`) the ring group (``ring_group``, default the registered
    one) runs ring attention after the all-to-all.  ``packed_seq_params`` (``thd``) takes
    ``cu_seqlens_q`` as the global document boundaries of the packed stream (see
    :func:`ulysses_mcore.megatron.batch.packed_seq_params`).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        ulysses_group=None,
        backend: Union[str, Kernel] = "sdpa",
        check: bool = True,
        token_order: Optional[str] = None,
        ring_group=None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        self.check = check
        self.current_max_attn_logits = None
        # Megatron shards a sequence over its context-parallel axis (which is Ulysses x ring
        # here) in dual-chunk order, and slices RoPE to match: follow it by default.
        cp_size = getattr(config, "context_parallel_size", 1)
        self.token_order = token_order or ("load_balanced" if cp_size > 1 else "contiguous")

        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        else:
            tp = dist.get_world_size(tp_group)
        self.group = ulysses_group if ulysses_group is not None else state.get_ulysses_group()
        self.degree = 1 if self.group is None else dist.get_world_size(self.group)
        self.ring_group = ring_group if ring_group is not None else state.get_ring_group()
        self.ring = 1 if self.ring_group is None else dist.get_world_size(self.ring_group)
        if (cp_size > 1 or self.ring > 1) and cp_size != self.degree * self.ring:
            raise ValueError(
                f"config.context_parallel_size={cp_size} but the Ulysses group has {self.degree} ranks and the "
                f"ring {self.ring}: Megatron's context-parallel size must be --ulysses-degree x "
                "--context-parallel-size; build the groups with ulysses_mcore.initialize(ulysses=..., cp=...)"
            )
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        if heads % tp or groups % tp:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} must divide --num-attention-heads {heads} "
                f"and --num-query-groups {groups}"
            )
        # Head counts live on the instance, never in process-global state.
        self.num_q_heads = heads // tp
        self.num_kv_heads = groups // tp
        self.head_dim = config.kv_channels
        err = head_layout_error(self.num_q_heads, self.num_kv_heads, self.degree)
        if err:
            raise ValueError(
                f"--ulysses-degree {self.degree} does not fit the heads per tensor-parallel rank "
                f"(tp={tp}, --num-attention-heads {heads}, --num-query-groups {groups}): {err}"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"UlyssesAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError(
                "UlyssesAttention does not implement sliding-window attention (config.window_size="
                f"{config.window_size}); unset --window-size"
            )
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        cu, order = None, self.token_order
        if packed_seq_params is not None:
            if getattr(packed_seq_params, "qkv_format", "thd") != "thd":
                raise ValueError(
                    f"UlyssesAttention: packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}; "
                    "packed sequences are supported in 'thd' format only"
                )
            cu = packed_seq_params.cu_seqlens_q
            cu_kv = packed_seq_params.cu_seqlens_kv
            if cu is None or (cu_kv is not None and cu_kv is not cu and not torch.equal(cu.cpu(), cu_kv.cpu())):
                raise ValueError(
                    "UlyssesAttention: packed_seq_params needs cu_seqlens_q (global document boundaries of the "
                    "packed stream) equal to cu_seqlens_kv for self-attention; build it with "
                    "ulysses_mcore.megatron.batch.packed_seq_params()"
                )
            padded = packed_seq_params.cu_seqlens_q_padded
            total = query.shape[0] * self.degree * self.ring
            whole = padded is not None and padded.numel() == 2 and int(padded[0]) == 0 and int(padded[-1]) == total
            if self.degree * self.ring > 1 and not whole:
                # Transformer Engine's / Megatron-LM's THD context-parallel layout: documents (padded
                # to 2 x CP) dealt out in dual chunks each; Megatron's RoPE follows it
                if self.ring > 1:
                    raise ValueError(
                        "UlyssesAttention: packed_seq_params in Transformer Engine's per-document THD "
                        "context-parallel layout cannot run with a ring (--context-parallel-size > 1 beside "
                        "--ulysses-degree); build the batch with ulysses_mcore.megatron.batch.pack_batch + "
                        "shard_batch (the stream sharded whole, cu_seqlens_*_padded = [0, total])"
                    )
                order = "per_document"
            if padded is not None and not whole:
                cu = padded  # tokens sit at their padded offsets
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        mask = None if mask_type in (AttnMaskType.causal, AttnMaskType.no_mask) or cu is not None else attention_mask
        out = ulysses_attention(
            query, key, value,
            group=self.group, causal=causal, layout="thd" if cu is not None else "sbhd", backend=self.backend,
            softmax_scale=self.softmax_scale, attention_mask=mask, attention_bias=attention_bias,
            dropout_p=self.dropout_p if self.training else 0.0, check=self.check,
            token_order=order, ring_group=self.ring_group, cu_seqlens=cu,
        )
        if cu is not None:
            return out.reshape(out.shape[0], -1)  # [t, h*d]; Megatron adds the batch dim back
        return out.reshape(out.shape[0], out.shape[1], -1)
