"""Attention variants under Ulysses (and Ulysses x ring) against float64 full-sequence attention,
forward and backward: multi-latent attention (value head dim != query/key head dim), sliding
windows, attention sinks (off-by-one, learnable), masks / biases that broadcast, and the
log-sum-exp output.

Tier 2: threaded process groups.  Every case checks the output, dq, dk, dv and, where they
exist, the log-sum-exp and the sinks' gradient (each rank's partial gradient summed over the
ranks, as Megatron's DDP sums a replicated weight's).  The lse cases backpropagate through
``out`` and ``lse`` both, so the lse's own gradient path is checked too.
"""

import pytest
import torch
import torch.distributed as dist

import ulysses_mcore
from ulysses_mcore.kernels import ring as ring_mod, sdpa
from ulysses_mcore.megatron.layer.batch import document_mask
from tests.helpers import count_collectives, reference_attention, run_threaded, run_threaded_errors
from tests.test_attention import FP32_RTOL, rel_err
from tests.test_ring import hybrid_groups, shard


def run_variant(
    U,
    C,
    S,
    b,
    hq,
    hk,
    d,
    dv,
    causal,
    *,
    window=None,
    sink=None,
    lse=False,
    layout="sbhd",
    mask_shape=None,
    bias_shape=None,
    order=None,
    cu=None,
    dtype=torch.float32,
    tile=None,
    monkeypatch=None,
    backend="sdpa",
):
    """Max relative errors [out, dq, dk, dv, (lse), (d sink)] of a U x C world vs float64."""
    order = order or ("load_balanced" if C > 1 else "contiguous")
    thd = cu is not None
    cu = torch.tensor(cu) if thd else None
    g = torch.Generator().manual_seed(U * 1000 + C * 100 + hq * 10 + hk + dv)
    shp = (lambda h, e: (S, b, h, e)) if layout == "sbhd" else (lambda h, e: (b, S, h, e))
    q, k, v = (
        torch.randn(shp(hq, d), generator=g),
        torch.randn(shp(hk, d), generator=g),
        torch.randn(shp(hk, dv), generator=g),
    )
    dout = torch.randn(shp(hq, dv), generator=g)
    dlse = torch.randn(shp(hq, dv)[:-1], generator=g)
    offset = {"off-by-one": torch.zeros(hq), "learnable": torch.randn(hq, generator=g), None: None}[sink]
    mask = (torch.rand(*mask_shape, generator=g) < 0.3) if mask_shape else None
    if mask is not None:
        mask[..., 0] = False  # every row keeps a key (a fully masked row is tested elsewhere)
    bias = torch.randn(*bias_shape, generator=g) if bias_shape else None
    if thd:
        q, k, v, dout, dlse = (t[:, 0] for t in (q, k, v, dout, dlse))
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    sd = 1 if layout == "bshd" else 0
    if tile is not None:
        monkeypatch.setattr(sdpa, "LSE_TILE", tile)

    def rank_fn(rank, world):
        ug, rg = hybrid_groups(rank, U, C)
        qs, ks, vs = (shard(t, rank, world, order, sd).clone().requires_grad_() for t in (q, k, v))
        off = offset.clone().requires_grad_(sink == "learnable") if offset is not None else None
        res = ulysses_mcore.ulysses_attention(
            qs,
            ks,
            vs,
            group=ug,
            ring_group=rg,
            causal=causal,
            layout="thd" if thd else layout,
            token_order=order,
            window_size=window,
            softmax_offset=off,
            return_lse=lse,
            attention_mask=mask,
            attention_bias=bias,
            cu_seqlens=cu,
            backend=backend,
        )
        out, l_ = res if lse else (res, None)
        loss = (out.float() * shard(dout, rank, world, order, sd).float()).sum()
        if lse:
            loss = loss + (l_ * shard(dlse, rank, world, order, sd)).sum()
        loss.backward()
        return (
            out.detach(),
            qs.grad,
            ks.grad,
            vs.grad,
            None if l_ is None else l_.detach(),
            None if off is None else off.grad,
        )

    res = run_threaded(U * C, rank_fn)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    offr = offset.double().requires_grad_() if offset is not None else None
    m = mask if not thd else document_mask(cu, S)
    up = (lambda t: t.unsqueeze(1)) if thd else (lambda t: t)
    ref = reference_attention(
        up(qr),
        up(kr),
        up(vr),
        causal=causal,
        layout=layout,
        attention_mask=m,
        attention_bias=bias,
        window_size=window,
        softmax_offset=offr,
        return_lse=True,
    )
    ro, rl = (ref[0].squeeze(1), ref[1].squeeze(1)) if thd else ref
    if m is not None:  # rows with no key at all: lse -inf on both sides, compared as 0
        rl = torch.where(torch.isinf(rl), torch.zeros_like(rl), rl)
    loss = (ro * dout.double()).sum() + ((rl * dlse.double()).sum() if lse else 0)
    loss.backward()
    want = [ro.detach(), qr.grad, kr.grad, vr.grad] + ([rl.detach()] if lse else [])
    world = U * C
    errs = [max(rel_err(res[r][i], shard(w, r, world, order, sd)) for r in range(world)) for i, w in enumerate(want)]
    if sink == "learnable":
        errs.append(rel_err(sum(r[5] for r in res), offr.grad))
    return errs


CASES = [
    # id, (U, C, S, b, hq, hk, d, dv, causal), options
    ("mla_u2", (2, 1, 16, 2, 4, 4, 12, 8, True), {}),
    ("mla_u4_gqa_replicated", (4, 1, 32, 2, 8, 2, 12, 8, True), {}),
    ("mla_u4_uneven7", (4, 1, 32, 1, 7, 7, 10, 6, False), {}),
    ("mla_u4_uneven28q7kv", (4, 1, 32, 1, 28, 7, 6, 4, True), {}),
    ("mla_bshd", (2, 1, 16, 3, 4, 2, 8, 16, True), {"layout": "bshd"}),
    ("mla_u2xring2", (2, 2, 32, 2, 4, 2, 12, 8, True), {}),
    ("window_causal_tiled", (2, 1, 64, 2, 4, 2, 8, 8, True), {"window": (9, 0), "tile": 8}),
    ("window_two_sided_tiled", (4, 1, 64, 1, 8, 2, 8, 8, False), {"window": (5, 11), "tile": 8}),
    ("window_left_only", (2, 1, 32, 2, 4, 4, 8, 8, False), {"window": (6, -1), "tile": 8}),
    ("window_uneven_heads", (4, 1, 32, 1, 6, 3, 8, 8, True), {"window": (4, 0), "tile": 8}),
    ("window_u2xring2", (2, 2, 64, 1, 4, 2, 8, 8, True), {"window": (7, 0)}),
    ("window_u2xring4_beyond_shards", (2, 4, 64, 1, 4, 4, 8, 8, True), {"window": (3, 0)}),
    ("window_packed_thd", (2, 1, 48, 1, 4, 2, 8, 8, True), {"window": (5, 0), "cu": [0, 13, 30, 48], "tile": 8}),
    ("sink_off_by_one", (2, 1, 16, 2, 4, 4, 8, 8, True), {"sink": "off-by-one"}),
    ("sink_learnable_gqa", (4, 1, 32, 2, 8, 2, 8, 8, True), {"sink": "learnable"}),
    ("sink_learnable_uneven", (4, 1, 32, 1, 7, 7, 8, 8, False), {"sink": "learnable"}),
    ("sink_learnable_u2xring2", (2, 2, 32, 2, 4, 2, 8, 8, True), {"sink": "learnable"}),
    ("lse_sbhd", (2, 1, 16, 2, 4, 4, 8, 8, True), {"lse": True}),
    ("lse_bshd_gqa", (4, 1, 32, 2, 8, 2, 8, 8, False), {"lse": True, "layout": "bshd"}),
    ("lse_uneven", (4, 1, 32, 1, 7, 7, 8, 8, True), {"lse": True}),
    ("lse_u2xring2", (2, 2, 32, 2, 4, 2, 8, 8, True), {"lse": True}),
    ("lse_pure_ring4", (1, 4, 32, 1, 4, 2, 8, 8, True), {"lse": True}),
    ("lse_packed_thd_ring", (2, 2, 32, 1, 4, 2, 8, 8, True), {"lse": True, "cu": [0, 7, 9, 25, 32]}),
    (
        "all_mla_window_sink_lse",
        (4, 1, 64, 1, 8, 2, 12, 8, True),
        {"window": (10, 0), "sink": "learnable", "lse": True, "tile": 16},
    ),
    ("all_u2xring2", (2, 2, 64, 1, 4, 2, 12, 8, True), {"window": (12, 0), "sink": "learnable", "lse": True}),
    ("mask_broadcast_rows", (2, 1, 16, 2, 4, 4, 8, 8, False), {"mask_shape": (2, 1, 1, 16)}),
    ("bias_broadcast_1x1x1xs_causal", (4, 1, 32, 2, 8, 2, 8, 8, True), {"bias_shape": (1, 1, 1, 32)}),
    ("bias_per_head_rows_broadcast", (2, 1, 16, 2, 4, 4, 8, 8, True), {"bias_shape": (1, 4, 1, 16)}),
    (
        "bias_mask_broadcast_ring",
        (2, 2, 32, 2, 4, 2, 8, 8, True),
        {"bias_shape": (2, 1, 1, 32), "mask_shape": (1, 1, 1, 32)},
    ),
    (
        "bias_broadcast_window_sink",
        (2, 1, 32, 2, 4, 4, 8, 8, True),
        {"bias_shape": (1, 1, 1, 32), "window": (6, 0), "sink": "learnable", "tile": 8},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_float64(case, monkeypatch):
    _, dims, opts = case
    errs = run_variant(*dims, monkeypatch=monkeypatch, **opts)
    assert max(errs) < FP32_RTOL, f"rel errors (out, dq, dk, dv[, lse][, dsink]) = {errs}"


def test_variants_bf16():
    """bf16 inputs: the float32 lse crosses the bf16 all-to-all bit-cast into two columns, exactly."""
    errs = run_variant(2, 1, 32, 2, 4, 2, 16, 8, True, window=(7, 0), sink="learnable", lse=True, dtype=torch.bfloat16)
    assert max(errs) < 2e-2, errs


def test_lse_crosses_the_exchange_bit_exactly():
    """Ulysses with return_lse returns the very lse the single-rank kernel computes, bf16 included."""
    g = torch.Generator().manual_seed(3)
    S, b, h, d = 32, 2, 4, 8
    q, k, v = (torch.randn(S, b, h, d, generator=g).bfloat16() for _ in range(3))
    _, whole = sdpa.sdpa_attention(q, k, v, causal=True, return_lse=True)

    def fn(rank, world):
        qs, ks, vs = (t.chunk(world)[rank] for t in (q, k, v))
        return ulysses_mcore.ulysses_attention(qs, ks, vs, group=dist.group.WORLD, causal=True, return_lse=True)[1]

    got = torch.cat(run_threaded(2, fn))
    assert got.dtype == torch.float32 and torch.equal(got, whole)


@pytest.mark.parametrize("lse", [False, True])
def test_variants_keep_two_all_to_alls_each_way(lse):
    """MLA + window + learnable sink (+ lse): still one all-to-all for q, k, v and one for the
    output (the lse inside it), forward and backward."""
    g = torch.Generator().manual_seed(5)
    S, b, hq, hk = 32, 1, 4, 2
    q, k, v = (
        torch.randn(S, b, hq, 12, generator=g),
        torch.randn(S, b, hk, 12, generator=g),
        torch.randn(S, b, hk, 8, generator=g),
    )

    def fn(rank, world):
        qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
        off = torch.zeros(hq, requires_grad=True)
        kw = dict(group=dist.group.WORLD, causal=True, window_size=(5, 0), softmax_offset=off, return_lse=lse)
        ulysses_mcore.ulysses_attention(qs, ks, vs, **kw)  # the first call of a signature validates
        n0 = c.get("all_to_all_single")
        res = ulysses_mcore.ulysses_attention(qs, ks, vs, **kw)
        n1 = c.get("all_to_all_single")
        (res[0].sum() + res[1].sum() if lse else res.sum()).backward()
        return n1 - n0, c.get("all_to_all_single") - n1

    with count_collectives() as c:
        res = run_threaded(2, fn)
    assert res[0] == (2, 2), res


def test_callable_gets_the_global_heads_it_holds():
    """A callable kernel with its own per-head sink parameter indexes it by the global heads it is
    told it holds (tensor-parallel offset included): the result equals the float64 reference."""
    g = torch.Generator().manual_seed(11)
    S, b, hq, d, first = 16, 2, 7, 8, 7  # 7 heads at P = 4 (2, 2, 2, 1); this "tp rank" holds heads 7..13
    model_sinks = torch.randn(14, generator=g)
    q, k, v = (torch.randn(S, b, hq, d, generator=g) for _ in range(3))
    seen = []

    def kernel(q, k, v, *, causal, softmax_scale, heads):
        seen.append(heads)
        out = ring_mod.ring_attention(
            q,
            k,
            v,
            group=None,
            causal=causal,
            softmax_scale=softmax_scale,
            softmax_offset=model_sinks[heads[0] : heads[1]],
        )
        return out

    def fn(rank, world):
        qs, ks, vs = (t.chunk(world)[rank] for t in (q, k, v))
        return ulysses_mcore.ulysses_attention(
            qs, ks, vs, group=dist.group.WORLD, causal=True, backend=kernel, first_head=first
        )

    got = torch.cat(run_threaded(4, fn))
    want = reference_attention(q, k, v, causal=True, softmax_offset=model_sinks[first : first + hq])
    assert rel_err(got, want) < FP32_RTOL
    assert sorted(seen) == [(7, 9), (9, 11), (11, 13), (13, 14)]


BAD = [
    ("window_not_pair", dict(window_size=(4,)), "window_size must be a pair (left, right)"),
    ("window_below_minus_one", dict(window_size=(-2, 0)), "ints >= -1"),
    ("offset_wrong_heads", dict(softmax_offset=torch.zeros(3)), "softmax_offset has 3 entries but query has 4 heads"),
    (
        "offset_int",
        dict(softmax_offset=torch.zeros(4, dtype=torch.long)),
        "softmax_offset must be a 1-D floating-point",
    ),
    ("lse_not_bool", dict(return_lse=1), "return_lse must be True or False"),
    ("flash_sink", dict(backend="flash", softmax_offset=torch.zeros(4)), None),  # flash not installed here
    ("dropout_with_window", dict(window_size=(3, 0), dropout_p=0.1), "does not combine with window_size"),
    (
        "bias_grad_with_sink",
        dict(softmax_offset=torch.zeros(4), attention_bias=torch.zeros(1, 1, 1, 16, requires_grad=True)),
        "treats the bias as a constant",
    ),
    (
        "callable_without_window",
        dict(window_size=(3, 0), backend=lambda q, k, v, *, causal, softmax_scale: q),
        "does not take a 'window_size' keyword",
    ),
    ("qk_head_dims_differ", dict(key_dim=6), "query and key disagree in head dim"),
    (
        "mask_bad_broadcast",
        dict(attention_mask=torch.zeros(2, 1, 3, 16, dtype=torch.bool)),
        "[b or 1, heads or 1, 16 or 1, 16]",
    ),
    ("ranks_disagree_in_window", dict(window_size=lambda r: (3 + r, 0)), "disagree in window_size"),
    (
        "overlap_with_lse",
        dict(overlap_chunks=2, return_lse=True),
        "overlap_chunks=2 takes one head dim and no return_lse",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_variant_input_same_error_on_every_rank(case):
    _, opts, text = case

    def fn(rank, world):
        kw = {k_: (v_(rank) if callable(v_) and k_ != "backend" else v_) for k_, v_ in opts.items()}
        kd = kw.pop("key_dim", 8)
        g = torch.Generator().manual_seed(0)
        q, v = torch.randn(8, 2, 4, 8, generator=g), torch.randn(8, 2, 4, 8, generator=g)
        k = torch.randn(8, 2, 4, kd, generator=g)
        ulysses_mcore.ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True, **kw)

    errs = run_threaded_errors(2, fn)
    msgs = [str(e) for e in errs]
    assert all(isinstance(e, ValueError) for e in errs), msgs
    assert len(set(msgs)) == 1, msgs
    if text:
        assert text in msgs[0], msgs[0]
