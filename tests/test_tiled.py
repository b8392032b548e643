"""The tiled log-sum-exp engine alone (no ring) against float64 attention by hand: windows, sinks,
value heads of another size, the log-sum-exp and its gradient, documents, and tiles of any size."""

import pytest
import torch

from ulysses_mcore.kernels import tiled
from ulysses_mcore.kernels.blocks import Scoring
from tests.helpers import reference_attention

S, B, HQ, HK, D = 20, 2, 4, 2, 8


def _qkv(seed, dv=D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = ((S, B, HQ, D), (S, B, HK, D), (S, B, HK, dv))
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


CASES = {
    "window": dict(causal=True, window_size=(5, 0)),
    "two-sided window": dict(causal=False, window_size=(3, 2)),
    "sink": dict(causal=True, softmax_offset=torch.linspace(-1, 1, HQ, dtype=torch.float64)),
    "mla": dict(causal=True, dv=6),
    "mask": dict(causal=False, attention_mask=torch.arange(S)[None, None, None, :] % 3 == 0),
}


@pytest.mark.parametrize("tile", [None, 3, 8])
@pytest.mark.parametrize("name", CASES)
def test_forward_backward_and_lse_match_float64(name, tile):
    """Output, log-sum-exp and every gradient (through ``out`` and ``lse`` both) of the engine equal
    the hand-written float64 reference, whatever the tile."""
    kw = dict(CASES[name])
    q, k, v = _qkv(7, dv=kw.pop("dv", D))
    sink = kw.get("softmax_offset")
    if sink is not None:
        kw["softmax_offset"] = sink = sink.clone().requires_grad_()
    out, lse = tiled.lse_attention(q, k, v, return_lse=True, tile=tile, **kw)
    ref_out, ref_lse = reference_attention(q, k, v, return_lse=True, **kw)
    assert (out - ref_out).abs().max() < 1e-10 and (lse - ref_lse).abs().max() < 1e-10
    g = torch.Generator().manual_seed(8)
    w_out, w_lse = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(lse.shape, generator=g).double()
    leaves = [q, k, v] + ([sink] if sink is not None else [])
    got = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), leaves)
    want = torch.autograd.grad((ref_out * w_out).sum() + (ref_lse * w_lse).sum(), leaves)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-9


def test_packed_documents_stay_inside_their_document():
    q, k, v = (t.detach()[:, :1] for t in _qkv(9))
    cu = torch.tensor([0, 6, 13, 20], dtype=torch.int32)
    out = tiled.lse_attention(q, k, v, causal=True, cu_seqlens=cu, tile=4)
    for lo, hi in ((0, 6), (6, 13), (13, 20)):
        ref = reference_attention(q[lo:hi], k[lo:hi], v[lo:hi], causal=True)
        assert (out[lo:hi] - ref).abs().max() < 1e-10


def test_a_walk_without_a_ring_is_one_step_over_the_whole_sequence():
    walk = tiled.Walk(Scoring((None, 0), 1.0), seq_len=10, tile=4)
    assert walk.size_rank() == (1, 0)
    assert walk.segments(0, 4) == [(0, 4), (4, 4), (8, 2)]
    assert walk.segments(0, None) == [(0, 10)]


def test_fp32_inputs_give_fp32_out_and_lse():
    q, k, v = (t.detach().float() for t in _qkv(10))
    out, lse = tiled.lse_attention(q, k, v, causal=True, window_size=(4, 0), return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out.double() - reference_attention(q, k, v, causal=True, window_size=(4, 0))).abs().max() < 1e-5
