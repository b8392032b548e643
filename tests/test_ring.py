"""Hybrid Ulysses x ring and packed (THD) attention against float64 full-sequence attention.

Tier 2: threaded process groups.  A world of ``U * C`` threads is cut into Ulysses groups
(contiguous ranks) and ring groups (stride ``U``), as Megatron's hierarchical context
parallelism does; rank ``u + U*j`` holds shard ``u + U*j`` of the sequence.
"""

import pytest
import torch
import torch.distributed as dist

import ulysses_mcore
from ulysses_mcore.megatron.layer.batch import document_mask
from ulysses_mcore.kernels.blocks import Scoring, blocks_of
from ulysses_mcore.kernels.ring import ring_attention, ring_segments
from tests.helpers import count_collectives, reference_attention, run_threaded, run_threaded_errors
from tests.test_attention import FP32_RTOL, make_inputs, rel_err


def hybrid_groups(rank, U, C):
    """(ulysses group, ring group) of ``rank`` in a world of U*C threads; checks the layout."""
    ug, rg = ulysses_mcore.new_sequence_groups(U, C)
    if ug is not None:
        assert dist.get_process_group_ranks(ug) == [u + U * (rank // U) for u in range(U)]
    if rg is not None:
        assert dist.get_process_group_ranks(rg) == [rank % U + U * j for j in range(C)]
    return ug, rg


def shard(t, c, n, order, dim):
    """Shard ``c`` of ``n`` of the full tensor along ``dim`` (contiguous or dual-chunk)."""
    S = t.shape[dim]
    return torch.cat([t.narrow(dim, s, m) for s, m in ring_segments(c, n, S, order)], dim=dim)


def run_hybrid(
    U, C, S, b, hq, hk, d, layout, causal, order, mask=False, bias=False, cu=None, backend="sdpa", dtype=torch.float32
):
    thd = cu is not None
    q, k, v, dout, m, bi = make_inputs(U * 100 + C * 10 + hq, S, b, hq, hk, d, layout, dtype, mask=mask, bias=bias)
    sd = 0 if layout == "sbhd" else 1
    if thd:  # packed stream: [t, h, d]
        q, k, v, dout = (t[:, 0] for t in (q, k, v, dout))

    def rank_fn(rank, world):
        ug, rg = hybrid_groups(rank, U, C)
        qs, ks, vs = (shard(t, rank, world, order, sd).clone().requires_grad_() for t in (q, k, v))
        out = ulysses_mcore.ulysses_attention(
            qs,
            ks,
            vs,
            group=ug,
            ring_group=rg,
            causal=causal,
            layout="thd" if thd else layout,
            attention_mask=m,
            attention_bias=bi,
            token_order=order,
            cu_seqlens=cu,
            max_seqlen=S if thd else None,  # as UlyssesAttention passes PackedSeqParams.max_seqlen_q
            backend=backend,
        )
        out.backward(shard(dout, rank, world, order, sd))
        return out.detach(), qs.grad, ks.grad, vs.grad

    res = run_threaded(U * C, rank_fn)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    if thd:
        ref = reference_attention(
            qr.unsqueeze(1), kr.unsqueeze(1), vr.unsqueeze(1), causal=causal, attention_mask=document_mask(cu, S)
        ).squeeze(1)
    else:
        ref = reference_attention(qr, kr, vr, causal=causal, layout=layout, attention_mask=m, attention_bias=bi)
    ref.backward(dout.double())
    want = (ref.detach(), qr.grad, kr.grad, vr.grad)
    return [max(rel_err(res[r][i], shard(w, r, U * C, order, sd)) for r in range(U * C)) for i, w in enumerate(want)]


HYBRID = [
    # U, C, S, b, hq, hk, d, layout, causal, order, mask/bias
    (2, 2, 32, 2, 4, 4, 8, "sbhd", True, "load_balanced", False),
    (2, 2, 32, 2, 4, 2, 8, "bshd", True, "load_balanced", True),
    (2, 2, 16, 1, 4, 4, 8, "sbhd", False, "contiguous", False),
    (4, 2, 64, 1, 8, 2, 8, "sbhd", True, "load_balanced", False),  # GQA, kv replicated x2 in the a2a
    (2, 4, 64, 2, 4, 1, 8, "sbhd", True, "load_balanced", True),  # MQA, ring of 4
    (2, 3, 48, 1, 6, 6, 8, "sbhd", True, "load_balanced", False),  # ring of 3
    (4, 2, 64, 1, 7, 7, 8, "sbhd", True, "load_balanced", False),  # uneven heads inside the hybrid
    (1, 4, 32, 2, 4, 2, 8, "sbhd", True, "load_balanced", True),  # pure ring (ulysses 1)
]


@pytest.mark.parametrize(
    "case",
    HYBRID,
    ids=lambda c: "U{}xC{}_q{}kv{}_{}_{}_{}{}".format(
        c[0], c[1], c[4], c[5], c[7], "causal" if c[8] else "full", c[9], "_mask_bias" if c[10] else ""
    ),
)
def test_hybrid_matches_float64(case):
    U, C, S, b, hq, hk, d, layout, causal, order, mb = case
    errs = run_hybrid(U, C, S, b, hq, hk, d, layout, causal, order, mask=mb, bias=mb)
    assert max(errs) < FP32_RTOL, f"rel errors out, dq, dk, dv = {errs}"


def test_hybrid_bf16():
    errs = run_hybrid(2, 2, 64, 2, 4, 2, 16, "sbhd", True, "load_balanced", dtype=torch.bfloat16)
    assert max(errs) < 2e-2, errs


PACKED = [
    # U, C, S, hq, hk, order, cu_seqlens (documents cross shard boundaries)
    (2, 1, 32, 4, 4, "contiguous", [0, 5, 19, 20, 32]),
    (4, 1, 32, 8, 2, "load_balanced", [0, 3, 11, 11, 30, 32]),  # an empty document too
    (4, 1, 36, 7, 7, "contiguous", [0, 13, 36]),  # uneven heads
    (2, 2, 32, 4, 2, "load_balanced", [0, 7, 9, 25, 32]),  # packed + hybrid ring
    (1, 2, 24, 4, 4, "contiguous", [0, 10, 24]),  # packed, pure ring
]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"U{c[0]}xC{c[1]}_q{c[3]}kv{c[4]}_{c[5]}_{len(c[6]) - 1}docs")
def test_packed_thd_matches_float64(case):
    U, C, S, hq, hk, order, cu = case
    errs = run_hybrid(U, C, S, 1, hq, hk, 8, "sbhd", True, order, cu=torch.tensor(cu, dtype=torch.int32))
    assert max(errs) < FP32_RTOL, f"rel errors out, dq, dk, dv = {errs}"


@pytest.mark.parametrize("P,hq,hk", [(2, 4, 4), (4, 8, 2), (4, 7, 7)])
def test_packed_per_document_layout_matches_float64(P, hq, hk):
    """token_order='per_document': Transformer Engine's / Megatron-LM's THD CP layout, every
    document (length a multiple of 2P) dealt out in dual chunks."""
    from ulysses_mcore.attention import per_document_order

    cu = torch.tensor([0, 2 * P, 2 * P, 8 * P, 10 * P], dtype=torch.int32)  # an empty document too
    T = int(cu[-1])
    q, k, v, dout, _, _ = make_inputs(P + hq, T, 1, hq, hk, 8, "sbhd")
    q, k, v, dout = (t[:, 0] for t in (q, k, v, dout))
    order = per_document_order(cu, P)
    n = T // P

    def rank_fn(rank, world):
        qs, ks, vs = (t[order[rank * n : (rank + 1) * n]].clone().requires_grad_() for t in (q, k, v))
        out = ulysses_mcore.ulysses_attention(
            qs, ks, vs, group=dist.group.WORLD, causal=True, layout="thd", cu_seqlens=cu, token_order="per_document"
        )
        out.backward(dout[order[rank * n : (rank + 1) * n]])
        return out.detach(), qs.grad, ks.grad, vs.grad

    res = run_threaded(P, rank_fn)
    qr, kr, vr = (t.double().unsqueeze(1).requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True, attention_mask=document_mask(cu, T))
    ref.backward(dout.double().unsqueeze(1))
    for i, want in enumerate((ref.detach(), qr.grad, kr.grad, vr.grad)):
        got = torch.cat([r[i] for r in res])
        assert rel_err(got, want.squeeze(1)[order]) < FP32_RTOL
    # the partition itself: rank 0 holds chunks 0 and 2P-1 of the first document (chunks of 1 token)
    assert order[:2].tolist() == [0, 2 * P - 1]


def test_new_sequence_groups_rejects_bad_sizes():
    errs = run_threaded_errors(4, lambda r, w: ulysses_mcore.new_sequence_groups(3, 1))
    assert all(isinstance(e, ValueError) and "new_sequence_groups(ulysses=3, cp=1)" in str(e) for e in errs), errs


def test_ring_collectives_and_block_skipping():
    """Forward: C-1 ring shifts; backward: 2C-1 (kv passes + the gradients' trip home)."""
    C, S = 4, 32
    q, k, v, dout, _, _ = make_inputs(9, S, 1, 4, 4, 8, "sbhd")

    def rank_fn(rank, world):
        qs, ks, vs = (shard(t, rank, world, "load_balanced", 0).clone().requires_grad_() for t in (q, k, v))
        s0 = c.get("all_to_all_single")  # a ring shift is an all_to_all_single with split sizes
        out = ring_attention(qs, ks, vs, group=dist.group.WORLD, causal=True)
        s1 = c.get("all_to_all_single")
        out.backward(shard(dout, rank, world, "load_balanced", 0))
        return s1 - s0, c.get("all_to_all_single") - s1

    with count_collectives() as c:
        fwd, bwd = run_threaded(C, rank_fn)[0]
    assert (fwd, bwd) == (C - 1, 2 * C - 1)
    # dual-chunk order balances causal work: every rank computes the same number of blocks
    work = [
        sum(
            len(
                list(
                    blocks_of(
                        ring_segments(j, C, S, "load_balanced"),
                        ring_segments(src, C, S, "load_balanced"),
                        Scoring((None, 0), 1.0),
                    )
                )
            )
            for src in range(C)
        )
        for j in range(C)
    ]
    assert len(set(work)) == 1, work


def _bad(U, C, **kw):
    """Each rank's exception when every rank calls with the given (possibly per-rank) arguments."""

    def fn(rank, world):
        ug, rg = hybrid_groups(rank, U, C)
        args = {k: (v(rank) if callable(v) else v) for k, v in kw.items()}
        S = args.pop("S", 16)
        t = torch.randn(S // world, 1, 4, 8)
        ulysses_mcore.ulysses_attention(
            t, t, t, group=ug, ring_group=rg, causal=True, token_order="load_balanced", **args
        )

    return run_threaded_errors(U * C, fn)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(backend="flash"), "backend='sdpa'"),
        (dict(dropout_p=0.1), "--attention-dropout 0"),
        (dict(S=lambda r: 32 if r == 3 else 16), "disagree in tokens per rank"),  # a rank of the *other* ring
        (dict(attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool)), "attention_mask must cover the full sequence"),
        (dict(cu_seqlens=torch.tensor([0, 16])), "pass layout='thd'"),
    ],
)
def test_hybrid_bad_input_same_error_everywhere(kw, needle):
    errs = _bad(2, 2, **kw)
    assert all(isinstance(e, ValueError) for e in errs), errs
    assert len({str(e) for e in errs}) == 1 and needle in str(errs[0]), str(errs[0])


def test_packed_bad_input():
    def fn(rank, world, cu, mask=None):
        t = torch.randn(8, 4, 8)
        ulysses_mcore.ulysses_attention(
            t, t, t, group=dist.group.WORLD, causal=True, layout="thd", cu_seqlens=cu, attention_mask=mask
        )

    for cu, needle in [
        (None, "needs cu_seqlens"),
        (torch.tensor([0, 5, 12]), "cu_seqlens ends at 12"),
        (torch.tensor([1, 5, 16]), "must start at 0"),
        (torch.tensor([0, 9, 5, 16]), "never decrease"),
    ]:
        errs = run_threaded_errors(2, fn, cu)
        assert all(isinstance(e, ValueError) and needle in str(e) for e in errs), (needle, errs)

    def per_doc(rank, world, cu):
        t = torch.randn(8, 4, 8)
        ulysses_mcore.ulysses_attention(
            t, t, t, group=dist.group.WORLD, causal=True, layout="thd", cu_seqlens=cu, token_order="per_document"
        )

    errs = run_threaded_errors(2, per_doc, torch.tensor([0, 6, 16]))
    assert all(isinstance(e, ValueError) and "multiple of 4" in str(e) for e in errs), errs
    errs = run_threaded_errors(2, fn, torch.tensor([0, 16]), torch.zeros(1, 1, 16, 16, dtype=torch.bool))
    assert all(isinstance(e, ValueError) and "takes no attention_mask" in str(e) for e in errs), errs

    def per_doc_ring(rank, world):
        ug, rg = hybrid_groups(rank, 2, 2)
        t = torch.randn(8, 4, 8)
        ulysses_mcore.ulysses_attention(
            t,
            t,
            t,
            group=ug,
            ring_group=rg,
            causal=True,
            layout="thd",
            cu_seqlens=torch.tensor([0, 32]),
            token_order="per_document",
        )

    errs = run_threaded_errors(4, per_doc_ring)
    assert all(isinstance(e, ValueError) and "does not combine with a ring" in str(e) for e in errs), errs
