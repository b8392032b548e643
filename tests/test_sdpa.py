"""The ``sdpa`` kernel alone (no ranks) against float64 attention by hand: plain and GQA, Megatron's
mask and an additive bias, packed documents with pads, and the routes to the tiled engine."""

import pytest
import torch

from ulysses_mcore.kernels import sdpa
from tests.helpers import reference_attention

S, B, HQ, HK, D = 24, 2, 4, 2, 8


def _qkv(seed, dv=D, b=B):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, b, HQ, D, generator=g)
    return q, torch.randn(S, b, HK, D, generator=g), torch.randn(S, b, HK, dv, generator=g)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("causal", [True, False])
def test_plain_and_gqa_match_float64(layout, causal):
    q, k, v = _qkv(0)
    if layout == "bshd":
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    out = sdpa.sdpa_attention(q, k, v, causal=causal, layout=layout, softmax_scale=0.3)
    ref = reference_attention(q, k, v, causal=causal, layout=layout, softmax_scale=0.3)
    assert out.shape == q.shape and (out.double() - ref).abs().max() < 1e-5


def test_mask_and_bias_match_float64():
    """A full ``[b, 1, S, S]`` mask (True = masked) and a per-head bias, with causality on top."""
    q, k, v = _qkv(1)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(B, 1, S, S, generator=g) < 0.3
    bias = torch.randn(1, HQ, S, S, generator=g)
    out = sdpa.sdpa_attention(q, k, v, causal=True, attention_mask=mask, attention_bias=bias)
    ref = reference_attention(q, k, v, causal=True, attention_mask=mask, attention_bias=bias)
    assert (out.double() - ref).abs().max() < 1e-5


def test_packed_documents_with_pads_equal_each_document_alone():
    """``cu_seqlens`` slots with ``seqlens`` real tokens: each document attends to itself only and the
    pad rows are zero."""
    q, k, v = _qkv(3, b=1)
    cu, lens = torch.tensor([0, 10, 24], dtype=torch.int32), torch.tensor([7, 14], dtype=torch.int32)
    out = sdpa.sdpa_attention(q, k, v, causal=True, cu_seqlens=cu, seqlens=lens)
    for lo, n, hi in ((0, 7, 10), (10, 14, 24)):
        ref = reference_attention(q[lo : lo + n], k[lo : lo + n], v[lo : lo + n], causal=True)
        assert (out[lo : lo + n].double() - ref).abs().max() < 1e-5
        assert not out[lo + n : hi].any()


def test_the_cpu_routes_what_sdpa_would_expand_to_the_tiled_engine():
    """Value heads of another size and a row-broadcast mask go to the tiled engine on the CPU (exact
    all the same); a full mask and a learnable bias stay with SDPA; dropout never goes there."""
    q, k, v = _qkv(4, dv=6)
    row_mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    row_mask[..., :3] = True
    assert sdpa.cpu_prefers_lse_kernel(q, v)
    assert sdpa.cpu_prefers_lse_kernel(q, q, attention_mask=row_mask)
    assert not sdpa.cpu_prefers_lse_kernel(q, q, attention_mask=row_mask.expand(B, 1, S, S))
    assert not sdpa.cpu_prefers_lse_kernel(q, v, attention_bias=torch.zeros(1, 1, 1, S, requires_grad=True))
    assert not sdpa.cpu_prefers_lse_kernel(q, v, dropout_p=0.1)
    out = sdpa.sdpa_attention(q, k, v, causal=False, attention_mask=row_mask)
    ref = reference_attention(q, k, v, causal=False, attention_mask=row_mask)
    assert out.shape == (S, B, HQ, 6) and (out.double() - ref).abs().max() < 1e-5


def test_window_sink_and_lse_need_no_dropout():
    q, k, v = _qkv(5)
    with pytest.raises(ValueError, match="dropout_p > 0 does not combine with window_size"):
        sdpa.sdpa_attention(q, k, v, causal=True, window_size=(4, 0), dropout_p=0.1)


def test_plain_kernel_only_where_nothing_needs_routing():
    """The prepared call's shortcut: bound SDPA for a plain call; None where a window, the lse or (on
    the CPU) value heads of another size need :func:`sdpa_attention`'s routing, or for another backend."""
    from ulysses_mcore.options import call_site

    q, k, v = _qkv(6)
    plain = sdpa.plain_sdpa_kernel(call_site(True, softmax_scale=0.3), q, v, True, "sbhd")
    ref = reference_attention(q, k, v, causal=True, softmax_scale=0.3)
    assert (plain(q, k, v).double() - ref).abs().max() < 1e-5
    assert sdpa.plain_sdpa_kernel(call_site(True, window_size=(3, 0)), q, v, True, "sbhd") is None
    assert sdpa.plain_sdpa_kernel(call_site(True, return_lse=True), q, v, True, "sbhd") is None
    assert sdpa.plain_sdpa_kernel(call_site(True), q, q[..., :6], True, "sbhd") is None
    assert sdpa.plain_sdpa_kernel(call_site(True, backend="te"), q, v, True, "sbhd") is None
