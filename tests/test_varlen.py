"""Packed documents for the fused kernels (ulysses_mcore.kernels.varlen), against the documents written out
by hand: the interleaved (real, pad) boundaries, the real rows, and a varlen call over padded slots
equal to running each real document alone."""

import torch

from tests.helpers import reference_attention
from ulysses_mcore.kernels.varlen import Documents, interleaved_boundaries, padded_varlen, real_token_rows, varlen_args


def test_boundaries_and_rows_of_padded_documents():
    cu, lens = torch.tensor([0, 8, 20, 24]), torch.tensor([5, 11, 3])
    assert interleaved_boundaries(cu, lens).tolist() == [0, 5, 8, 19, 20, 23, 24]
    want = [i < 5 or 8 <= i < 19 or 20 <= i < 23 for i in range(24)]
    assert real_token_rows(cu, lens, 24).tolist() == want
    cu32, longest = varlen_args(cu, torch.device("cpu"))
    assert cu32.dtype == torch.int32 and longest == 12
    assert varlen_args(cu, torch.device("cpu"), max_seqlen=16)[1] == 16  # the caller's bound: no host read


def _per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, causal=True):
    """A varlen kernel written out: each sequence of the boundaries attends to itself."""
    out = torch.zeros_like(q)
    b = cu_q.tolist()
    for lo, hi in zip(b[:-1], b[1:]):
        ref = reference_attention(q[lo:hi, None], k[lo:hi, None], v[lo:hi, None], causal=causal)
        out[lo:hi] = ref[:, 0].to(q.dtype)
    return out


def test_a_varlen_call_over_padded_slots_equals_each_document_alone():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 1, 2, 8, generator=g) for _ in range(3))
    cu, lens = torch.tensor([0, 8, 20, 24]), torch.tensor([5, 11, 3])
    out = padded_varlen(_per_sequence, {}, (q, k, v), Documents(cu, lens))
    for lo, n in ((0, 5), (8, 11), (20, 3)):
        ref = reference_attention(q[lo : lo + n], k[lo : lo + n], v[lo : lo + n], causal=True)
        torch.testing.assert_close(out[lo : lo + n].double(), ref, rtol=1e-5, atol=1e-6)
    pad = ~real_token_rows(cu, lens, 24)
    assert out[pad].abs().max() == 0  # pad rows come back zero
