"""ulysses_mcore.call: a signature is validated and prepared once, then reused; the cache key
sees every input the verdict depends on."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.helpers import count_collectives, reference_attention, run_threaded
from ulysses_mcore.call import CallCache, call_key, lse_columns
from ulysses_mcore.options import NO_TENSORS, CallTensors, call_site

OPTS = SITE = call_site(True)


def whole_world(opts=OPTS, **kw):
    """A call site over the whole world (threads)."""
    return replace(opts, group=dist.group.WORLD, **kw)


def test_key_sees_shapes_dtypes_grads_options_groups():
    q = torch.randn(4, 1, 2, 8)
    base = call_key((q, q, q), SITE)
    assert base == call_key((q.clone(), q.clone(), q.clone()), SITE, NO_TENSORS)
    others = [
        call_key((q[:2], q[:2], q[:2]), SITE),
        call_key((q.double(), q, q), SITE),
        call_key((q.clone().requires_grad_(), q, q), SITE),
        call_key((q, q, q), call_site(False)),
        call_key((q, q, q), replace(OPTS, group=object())),
        call_key((q, q, q), replace(OPTS, first_head=2)),
        call_key((q, q, q), replace(OPTS, checks=(("expected_heads", (2, 2)),))),
        call_key((q, q, q), SITE, CallTensors(attention_mask=torch.zeros(1, 1, 4, 4, dtype=torch.bool))),
        call_key((q, q, q), SITE, CallTensors(qkv_format="thd")),
    ]
    assert all(k != base for k in others) and len(set(others)) == len(others)
    assert call_key(("not a tensor", q, q), SITE) is None


def test_a_new_batchs_boundaries_are_not_a_new_signature():
    """Every packed micro-batch has its own documents: neither their values nor their count is
    part of the key (validated on the first batch, trusted later), nor the host max_seqlen; their
    dtype and device are."""
    q = torch.randn(8, 2, 4)

    def key(cu, **kw):
        return call_key((q, q, q), SITE, CallTensors(cu_seqlens=cu, **kw))

    a = key(torch.tensor([0, 3, 8]))
    assert a == key(torch.tensor([0, 5, 8])) == key(torch.tensor([0, 1, 2, 8]))
    assert a == key(torch.tensor([0, 8]), max_seqlen=8)
    assert a != key(torch.tensor([0, 3, 8], dtype=torch.int32))
    kv = key(torch.tensor([0, 8]), cu_seqlens_kv=torch.tensor([0, 8]))  # the kv boundaries alike
    assert kv == key(torch.tensor([0, 3, 8]), cu_seqlens_kv=torch.tensor([0, 3, 8])) != a
    assert a != call_key((q, q, q), SITE)


def test_prepared_once_then_reused():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 1, 4, 8, generator=g) for _ in range(3))

    def fn(rank, world):
        cache = CallCache()
        outs = []
        for S in (16, 16, 8, 16):
            qs, ks, vs = (t[:S].chunk(world)[rank] for t in (q, k, v))
            before = c.get("all_gather_object")
            outs.append(cache.run(qs, ks, vs, whole_world()))
            outs.append(c.get("all_gather_object") - before)
        return outs, len(cache.entries)

    with count_collectives() as c:
        res = run_threaded(2, fn)
    for outs, entries in res:
        assert outs[1::2] == [1, 0, 1, 0] and entries == 2  # two signatures, each validated once
    out = torch.cat([r[0][0] for r in res])
    assert (out.double() - reference_attention(q, k, v, causal=True)).abs().max() < 1e-5


def test_lse_columns():
    assert lse_columns(torch.float32) == 1 and lse_columns(torch.float64) == 1
    assert lse_columns(torch.bfloat16) == 2 and lse_columns(torch.float16) == 2


def test_the_lse_ring_refuses_padded_documents_it_cannot_honour():
    """Called directly (validation refuses it first), the ring kernel names what it cannot do."""
    import pytest

    from ulysses_mcore.call import ring_kernel

    kernel = ring_kernel("sdpa", None, "contiguous")
    q = torch.randn(8, 1, 2, 4)
    with pytest.raises(ValueError, match="seqlens"):
        kernel(q, q, q, causal=True, cu_seqlens=torch.tensor([0, 8]), seqlens=torch.tensor([6]))


# ----------------------------------------------------------------------------- bounds and agreement
def test_cache_is_bounded_in_entries_and_bytes_and_stays_exact():
    """Hundreds of distinct shapes (load-balanced order: each prepared call keeps index tensors, an
    order and its inverse of the gathered sequence, int64): the cache never holds more than its
    bounds, prices what it holds at those bytes, and every call is still exact."""

    opts = call_site(True, token_order="load_balanced")

    def full(i):
        g = torch.Generator().manual_seed(i)
        return [torch.randn(8 * (i % 150 + 1), 1, 2, 4, generator=g) for _ in range(3)]

    def fn(rank, world):
        cache = CallCache(max_entries=32, max_bytes=48 << 10)
        worst, outs = 0, {}
        for i in range(300):
            shards = [torch.cat([c[rank], c[2 * world - 1 - rank]]) for c in (t.chunk(2 * world) for t in full(i))]
            out = cache.run(*shards, whole_world(opts))
            worst = max(worst, cache.held)
            shard_tokens = [key[1][0][0] for key in cache.entries]  # the key: (choices, q's signature, ...)
            assert cache.held == sum(2 * (world * n) * 8 for n in shard_tokens)
            if i % 60 == 7:
                outs[i] = out
        return worst, len(cache.entries), outs

    res = run_threaded(2, fn)
    for worst, entries, _ in res:
        assert 0 < worst <= 48 << 10 and entries <= 32
    for i in res[0][2]:
        chunks = [None] * 4
        for r, (_, _, outs) in enumerate(res):
            a, b = outs[i].chunk(2)
            chunks[r], chunks[3 - r] = a, b
        want = reference_attention(*full(i), causal=True)
        assert (torch.cat(chunks).double() - want).abs().max() < 1e-5, i


def test_cache_key_digest_is_the_same_in_every_process_for_the_same_call():
    from ulysses_mcore.call import digest

    q = torch.randn(4, 1, 2, 8)
    site = replace(OPTS, checks=(("expected_heads", (2, 2)),))
    k1 = call_key((q, q, q), site)
    k2 = call_key((q.clone(), q, q), replace(OPTS, checks=(("expected_heads", (2, 2)),)))
    k3 = call_key((q[:2], q[:2], q[:2]), site)
    assert digest(k1) == digest(k2) != digest(k3)
    assert 0 <= digest(k1) < 1 << 62


def test_every_call_agreement_turns_a_late_mismatch_into_the_same_error_on_every_rank():
    """Both ranks' signatures A and B were checked and cached; then rank 0 calls A while rank 1
    calls B.  With check="every_call" both raise the same ValueError (plain caching would enter an
    all-to-all of mismatched sizes)."""

    def fn(rank, world):
        cache = CallCache()
        a = [torch.randn(4, 1, 2, 8) for _ in range(3)]
        b = [torch.randn(6, 1, 2, 8) for _ in range(3)]
        for x in (a, b):
            cache.run(*x, whole_world(check="every_call"))
        cache.run(*a, whole_world(check="every_call"))  # agreeing: runs
        with pytest.raises(ValueError) as e:
            cache.run(*(a if rank == 0 else b), whole_world(check="every_call"))
        return str(e.value)

    first, second = run_threaded(2, fn)
    assert first == second and "ulysses_attention:" in first
    assert "4" in first and "6" in first  # the full check names the shapes that differ


def test_every_call_agreement_is_one_small_all_reduce():
    def fn(rank, world):
        cache = CallCache()
        x = [torch.randn(4, 1, 2, 8) for _ in range(3)]
        cache.run(*x, whole_world(check="every_call"))
        names = c.NAMES
        before = {n: c.get(n) for n in names}
        cache.run(*x, whole_world(check="every_call"))
        return {n: c.get(n) - before[n] for n in names if c.get(n) != before[n]}

    with count_collectives() as c:
        res = run_threaded(2, fn)
    for d in res:
        assert d == {"all_reduce": 1, "all_to_all_single": 2}, d


@pytest.mark.parametrize("order", ["new/cached", "cached/new", "new/new", "both cached, swapped"])
def test_every_call_never_hangs_whatever_each_rank_has_cached(order):
    """Rank 0 and rank 1 call different signatures; which of them each rank met before varies.
    Every order ends in the same ValueError on both ranks (no rank in a collective its peer skips)."""

    def fn(rank, world):
        cache = CallCache()
        a = [torch.randn(4, 1, 2, 8) for _ in range(3)]
        b = [torch.randn(6, 1, 2, 8) for _ in range(3)]
        seen = {"new/cached": [a], "cached/new": [a], "new/new": [], "both cached, swapped": [a, b]}[order]
        for x in seen:  # both ranks make the same earlier calls
            cache.run(*x, whole_world(check="every_call"))
        mine = {"new/cached": (b, a), "cached/new": (a, b), "new/new": (b, [t[:2] for t in b])}.get(order, (b, a))
        with pytest.raises(ValueError) as e:
            cache.run(*mine[rank], whole_world(check="every_call"))
        return str(e.value)

    first, second = run_threaded(2, fn, timeout=60)
    assert first == second and "ulysses_attention:" in first


def test_every_call_refuses_boundaries_that_differ_between_ranks_on_a_later_micro_batch():
    """Packed documents: the same signature, cu_seqlens [0, 10, 32] on one rank and [0, 20, 32] on the
    other after an agreeing first batch -- the same ValueError on both (the default check trusts later
    boundaries; every_call agrees on them: a device-side digest in the same all-reduce)."""
    thd = call_site(causal=True, layout="thd")

    def fn(rank, world):
        cache = CallCache()
        q, k, v = (torch.randn(16, 2, 8) for _ in range(3))
        first = CallTensors(cu_seqlens=torch.tensor([0, 16, 32]))
        cache.run(q, k, v, whole_world(thd, check="every_call"), first)
        later = CallTensors(cu_seqlens=torch.tensor([0, 10, 32] if rank == 0 else [0, 20, 32]))
        with pytest.raises(ValueError) as e:
            cache.run(q, k, v, whole_world(thd, check="every_call"), later)
        return str(e.value)

    first, second = run_threaded(2, fn, timeout=60)
    assert first == second and "cu_seqlens" in first


def test_without_an_exchange_the_kernel_saves_its_own_v_not_the_packed_projection():
    """At ulysses 1 v arrives as a slice of the layer's packed QKV projection while RoPE made q and k
    anew: the kernel saves a copy of v, so the projection is not held until the backward; values and
    gradients are the reference's."""
    g = torch.Generator().manual_seed(3)
    s, heads, d = 32, 2, 8
    packed = torch.randn(s, 1, heads, 3 * d, dtype=torch.float64, generator=g).requires_grad_()
    q, k, v = packed.split(d, dim=-1)
    q, k = q * 1.0, k * 1.0  # RoPE's new tensors
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = CallCache().run(q, k, v, SITE)
    held = packed.untyped_storage()._cdata in {t.untyped_storage()._cdata for t in saved}
    assert not held, "the packed projection is saved for the backward (v's own copy should be)"
    assert (out - reference_attention(q, k, v, causal=True)).abs().max() < 1e-12
    (grad,) = torch.autograd.grad(out.square().sum(), packed, retain_graph=True)
    (want,) = torch.autograd.grad(reference_attention(q, k, v, causal=True).square().sum(), packed)
    assert (grad - want).abs().max() < 1e-10
