"""A validated call signature, prepared once: what a steady-state attention call runs.

The first call of a signature is validated on every rank alike and turned into a
:class:`PreparedCall` (head plan, routes, kernel and its keywords, index permutations); later calls
pay one dict lookup on :func:`call_key`, two collectives and the kernel.  :class:`CallCache`
holds them: one per ``UlyssesAttention`` module, one (bounded) for the functional API.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .exchange.heads import HeadPlan, seq_dim
from .exchange.orders import BATCH, held_bytes, token_orders
from .exchange.overlap import ChunkRoutes, OverlappedUlysses
from .exchange.pair import exchange_out, exchange_qkv, kv_index, pack_lse, unpack_lse
from .exchange.routes import OutRoute, Shard, qkv_route
from .exchange.transport import POOL
from .kernels.registry import resolve
from .kernels.ring import ring_attention
from .kernels.sdpa import plain_sdpa_kernel
from .kernels.te import TEKernel
from .options import NO_TENSORS, PER_CALL, CallSite, CallTensors
from .validation.agreement import agree_call, digest
from .validation.record import check_call, group_sizes

# (index in CallTensors, how it is keyed) of each per-call field that is part of a signature
_KEYED = tuple((CallTensors._fields.index(name), f.key) for name, f in PER_CALL.items() if f.key)


def _tensor_key(kind: str, t):
    """A tensor's part of the signature: shape, dtype, device, requires_grad -- and for document
    boundaries no shape and no values (every packed micro-batch has its own documents: the first
    batch of a signature is validated, later ones are trusted, and nothing is read on the host)."""
    if t is None or kind == "value":
        return t
    if not isinstance(t, torch.Tensor):
        return ("not a tensor", type(t).__name__)
    if kind == "boundaries" and t.dim() == 1 and not t.is_floating_point():
        return ("boundaries", t.dtype, t.device)
    return (t.shape, t.dtype, t.device, t.requires_grad)


def call_key(qkv, choices, tensors: CallTensors = NO_TENSORS):
    """The cache key of a call: the caller's ``choices`` (what decides its :class:`CallSite`: a tuple
    of plain values, or the site itself), then one tuple of shapes, dtypes, devices and flags
    (``None`` when an input is not a tensor or a choice is unhashable: such a call is validated
    every time, and fails)."""
    try:
        key = (choices,) + tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in qkv)
        if tensors is not NO_TENSORS:
            key += tuple(_tensor_key(kind, tensors[i]) for i, kind in _KEYED)
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


LIVE_CACHES: weakref.WeakSet[CallCache] = weakref.WeakSet()  # every cache of prepared calls (release())


def release(caches) -> None:
    """Empty ``caches`` (of prepared calls, with the process groups and kernel modules they hold),
    then what every call shares: this thread's exchange buffers and the host copies of the current
    micro-batch's document boundaries.  The package's one release (:func:`ulysses_mcore.release`
    passes the functional API's cache, the exit hook every cache)."""
    for cache in list(caches):
        cache.clear()
    POOL.clear()
    BATCH.clear()


def _same(site: CallSite) -> CallSite:
    return site


class CallCache:
    """Prepared calls by :func:`call_key`, bounded: at most ``max_entries`` of them and ``max_bytes``
    of the tensors they hold; the oldest go first.  ``check="every_call"``: every call first agrees
    with its group (:meth:`_every_call`), so ranks whose calls differ raise the same ``ValueError``
    instead of entering an all-to-all of mismatched sizes or a collective their peers never enter."""

    def __init__(self, site_of=_same, max_entries: int = 256, max_bytes: int = 256 << 20):
        LIVE_CACHES.add(self)
        self.site_of = site_of  # a call's choices -> its CallSite, built when its first signature is prepared
        self.entries: dict = {}
        self.sizes: dict = {}
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.held = 0

    def run(self, q, k, v, choices, tensors: CallTensors = NO_TENSORS):
        """Attention of this call: the prepared call of its signature, made (and validated when
        ``site.check``) the first time; ``choices`` as :func:`call_key` takes them."""
        qkv = (q, k, v)
        key = call_key(qkv, choices, tensors)
        call = self.entries.get(key) if key is not None else None
        site = call.site if call is not None else self.site_of(choices)
        validate = site.check
        if site.check == "every_call" and site.group is not None and dist.get_world_size(site.group) > 1:
            validate = self._every_call(key, call, qkv, site, tensors)
            if validate and call is not None:  # a peer's first call of this signature: check together
                check_call(qkv, site, tensors)
        if call is None:
            call = self.prepare(key, qkv, site, tensors, validate=validate)
        return call(q, k, v, tensors)

    def _every_call(self, key, call, qkv, site: CallSite, tensors: CallTensors) -> bool:
        """``check="every_call"``, before anything else of the call and whether its signature is
        cached here or not: one all-reduce agrees on the signature, the document boundaries and
        whether any rank sees the signature for the first time.  Ranks that differ all run the full
        check and raise the same ``ValueError``; otherwise returns whether to validate (together)."""
        sig = call.digest if call is not None else digest(key)
        bounds = (tensors.cu_seqlens, tensors.seqlens)
        same, anyone_new = agree_call(sig, bounds, call is None, site.group, qkv[0].device)
        if not same:
            self._disagreement(qkv, site, tensors)
        return anyone_new

    def prepare(self, key, qkv, site: CallSite, tensors: CallTensors, *, validate=True):
        ulysses, ring = group_sizes(site)
        if ulysses < 1 or ring < 1:  # no peer waits on a rank outside the group: raising here is safe
            raise ValueError(
                f"ulysses_attention: rank {dist.get_rank()} is not a member of the "
                f"{'group' if ulysses < 1 else 'ring_group'} it was given; pass this rank's own group"
            )
        if validate:
            check_call(qkv, site, tensors)
        call = PreparedCall(qkv, site, tensors)
        call.digest = digest(key)
        if key is not None:
            self._keep(key, call)
        return call

    def _keep(self, key, call) -> None:
        size = call.nbytes
        while self.entries and (len(self.entries) >= self.max_entries or self.held + size > self.max_bytes):
            old = next(iter(self.entries))  # the oldest signature
            del self.entries[old]
            self.held -= self.sizes.pop(old)
        if size <= self.max_bytes:
            self.entries[key], self.sizes[key] = call, size
            self.held += size

    def clear(self) -> None:
        self.entries.clear()
        self.sizes.clear()
        self.held = 0

    @staticmethod
    def _disagreement(qkv, site: CallSite, tensors: CallTensors):
        """Every rank of the group is here (the agreement's result is the same everywhere): the full
        check names the difference, the same on every rank."""
        check_call(qkv, site, tensors)
        raise ValueError(
            "ulysses_attention: the ranks of the group called with different signatures (shapes, dtypes, "
            "options or document boundaries); call with the same shapes and cu_seqlens on every rank"
        )


def lse_columns(dtype: torch.dtype) -> int:
    """Columns of ``dtype`` one log-sum-exp value takes (float32, or float64 beside float64)."""
    lse = torch.float64 if dtype == torch.float64 else torch.float32
    return max(1, lse.itemsize // dtype.itemsize)


def slice_of_another_buffer(t: torch.Tensor, others) -> bool:
    """Whether ``t`` is a part of a larger storage that none of ``others`` shares (read from shapes and
    storages on the host: no sync)."""
    storage = t.untyped_storage()
    if storage.nbytes() <= t.numel() * t.element_size():
        return False
    return all(o.untyped_storage()._cdata != storage._cdata for o in others)


class PreparedCall:
    """Everything about one call signature that does not change from call to call."""

    def __init__(self, qkv, site: CallSite, tensors: CallTensors):
        q, k, v = qkv
        ulysses, ring = group_sizes(site)
        self.site, self.group, self.ring_group = site, site.group, site.ring_group
        self.thd = site.layout == "thd"
        self.layout = "sbhd" if self.thd else site.layout
        if self.thd:
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        self.kw = site.kernel_keywords(self.layout)
        self.exchange = ulysses > 1
        rank = dist.get_rank(site.group) if self.exchange else 0
        self.plan = HeadPlan(q.shape[2], k.shape[2], ulysses)
        self.lo, self.hi = self.plan.q_range(rank)
        self.head0 = site.first_head
        self.kw["heads"] = (self.head0 + self.lo, self.head0 + self.hi)
        self.kv_index = kv_index(self.plan, rank, q.device) if self.exchange else None
        self.nbytes = 0 if self.kv_index is None else self.kv_index.nbytes  # what the cache prices it at
        kv_local = self.hi - self.lo if self.kv_index is not None else self.plan.kv_count(rank)
        kernel = site.kernel
        if kernel is None:
            kernel, self.kw = self._kernel((q, v), ring, tensors, gqa=kv_local != self.hi - self.lo)
        self.kernel = kernel
        # without an exchange the kernel saves v as it comes: a slice of the layer's packed QKV projection
        # (q and k made anew by RoPE) would keep the whole projection alive until the backward; a copy of v
        # keeps v's bytes only (Llama-3-8B: 1.25 [s, h] less at the recomputed layer's peak, the dry run)
        self.own_value = not self.exchange and slice_of_another_buffer(v, (q, k))
        if self.exchange:
            self._routes(q, v, rank, site)

    def _kernel(self, qv, ring: int, tensors, gqa: bool):
        """(the kernel, the keywords it is called with)."""
        site = self.site
        if ring > 1:
            return ring_kernel(site.backend, self.ring_group, site.token_order), self.kw
        if tensors is NO_TENSORS:  # nothing per call: the plain SDPA call, its keywords bound once
            fast = plain_sdpa_kernel(site, *qv, gqa, self.layout)
            if fast is not None:
                return fast, {}
        return resolve(site.backend), self.kw

    def _routes(self, q, v, rank, site: CallSite):
        plan, dv = self.plan, v.shape[3]
        self.qkv = qkv_route(q, v, plan, rank, self.layout)
        A, B = q.shape[0], q.shape[1]
        self.dv = dv
        self.out = OutRoute(plan, rank, Shard(A, B, dv + (lse_columns(q.dtype) if site.return_lse else 0)), self.layout)
        sd = seq_dim(self.layout)
        self.orders = token_orders(site.token_order, plan.ulysses, q.shape[sd] * plan.ulysses, q.device, sd)
        self.nbytes += held_bytes(site.token_order, q.shape[sd] * plan.ulysses)
        if site.overlap_chunks > 1:
            self.chunks = ChunkRoutes(plan, rank, site.overlap_chunks, Shard(A, B, q.shape[3]), self.layout)

    # ------------------------------------------------------------------------- per call
    def __call__(self, q, k, v, tensors):
        if self.thd:
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        if not self.exchange:
            if self.own_value:
                v = v.clone(memory_format=torch.contiguous_format)
            out = self.kernel(q, k, v, **self._kw(tensors, 0, self.hi))
        elif self.site.overlap_chunks > 1:
            out = self._overlapped(q, k, v, tensors)
        else:
            out = self._exchanged(q, k, v, tensors)
        if self.thd:
            return (out[0].squeeze(1), out[1].squeeze(1)) if self.site.return_lse else out.squeeze(1)
        return out

    def _kw(self, tensors, lo, hi):
        """The kernel's keywords: the fixed ones, plus this call's tensors (mask / bias / sinks cut to
        the heads ``lo .. hi`` held here)."""
        if tensors is NO_TENSORS:
            return self.kw
        kw = dict(self.kw)
        for name in ("attention_mask", "attention_bias"):
            t = getattr(tensors, name)
            if t is not None:
                kw[name] = t if t.shape[1] == 1 or not self.exchange else t[:, lo:hi]
        for name in ("cu_seqlens", "seqlens", "max_seqlen"):
            if getattr(tensors, name) is not None:
                kw[name] = getattr(tensors, name)
        if tensors.softmax_offset is not None:  # this rank's heads' sinks: autograd routes their gradient back
            kw["softmax_offset"] = tensors.softmax_offset[lo:hi] if self.exchange else tensors.softmax_offset
        return kw

    def _exchanged(self, q, k, v, tensors):
        qh, kh, vh = exchange_qkv(q, k, v, self.group, self.qkv)
        if self.kv_index is not None:
            kh, vh = kh.index_select(2, self.kv_index), vh.index_select(2, self.kv_index)
        out = self._attend(qh, kh, vh, tensors, (self.lo, self.hi - self.lo))
        if self.site.return_lse:  # the lse rides in the output's all-to-all, bit-cast into extra columns
            out, lse = out
            return unpack_lse(exchange_out(pack_lse(out, lse), self.group, self.out), self.dv, lse.dtype)
        return exchange_out(out, self.group, self.out)

    def _attend(self, q, k, v, tensors, heads):
        """The kernel on this rank's heads ``first .. first + count`` (``heads = (first, count)``), in
        natural token order."""
        first, count = heads
        kw = self._kw(tensors, first, first + count)
        if count != self.hi - self.lo:  # a head chunk (overlap): the global heads it holds
            kw = dict(kw, heads=(self.head0 + first, self.head0 + first + count))
        if self.orders is None:
            return self.kernel(q, k, v, **kw)
        to_natural, to_received = self.orders(tensors.cu_seqlens)
        res = self.kernel(to_natural(q), to_natural(k), to_natural(v), **kw)
        if self.site.return_lse:
            return to_received(res[0]), to_received(res[1])
        return to_received(res)

    def _overlapped(self, q, k, v, tensors):
        qc = self.chunks.qc
        attend = lambda lq, lk, lv, c: self._attend(lq, lk, lv, tensors, (self.lo + c * qc, qc))  # noqa: E731
        return OverlappedUlysses.apply(q, k, v, self.group, (self.chunks, attend))


def ring_kernel(backend, ring_group, token_order: str):
    """The inner kernel when a ring follows the all-to-all: this rank's ring shard in, out."""
    if backend == "te":
        return TEKernel(ring_group)

    def lse_ring(q, k, v, *, seqlens=None, heads=None, max_seqlen=None, **kw):
        """The log-sum-exp ring over ``ring_group``: every keyword as the tiled kernel takes it
        (``heads`` is informational, ``max_seqlen`` unneeded: the ring reads its boundaries once
        per micro-batch)."""
        if seqlens is not None:  # validation refuses it first; a direct caller hears why here
            raise ValueError(
                "the log-sum-exp ring takes packed documents without padding between them (cu_seqlens only): "
                "seqlens (padded documents) cannot run with a ring"
            )
        return ring_attention(q, k, v, group=ring_group, token_order=token_order, **kw)

    return lse_ring
