"""ulysses_mcore.exchange.orders: the token orders of a sharded sequence and the index tensors that undo them."""

import pytest
import torch

from ulysses_mcore.exchange.orders import document_ids, load_balanced_permutation, per_document_order, token_orders


def _dual_chunk_received(seq, P):
    """Reference: rank r holds chunks r and 2P-1-r; the all-to-all delivers rank 0's, then rank 1's ..."""
    ch = seq.chunk(2 * P)
    return torch.cat([torch.cat([ch[r], ch[2 * P - 1 - r]]) for r in range(P)])


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_load_balanced_reorder_is_the_dual_chunk_order(P):
    S = 2 * P * 3
    natural = torch.arange(S)
    received = _dual_chunk_received(natural, P)
    to_natural, to_received = token_orders("load_balanced", P, S, "cpu", 0)(None)
    assert torch.equal(to_natural(received), natural)
    assert torch.equal(to_received(natural), received)
    assert load_balanced_permutation(2) == [0, 3, 1, 2]


def test_contiguous_needs_no_reorder():
    assert token_orders("contiguous", 4, 16, "cpu", 0) is None


def test_per_document_order_against_dealing_each_document():
    P, cu = 2, torch.tensor([0, 8, 12, 24])
    docs = [torch.arange(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    # rank r holds chunks r and 2P-1-r of every document, documents in order
    ranks = [torch.cat([torch.cat([d.chunk(2 * P)[r], d.chunk(2 * P)[2 * P - 1 - r]]) for d in docs]) for r in range(P)]
    assert torch.equal(per_document_order(cu, P), torch.cat(ranks))
    to_natural, _ = token_orders("per_document", P, 24, "cpu", 1)(cu)
    x = torch.cat(ranks).view(1, 24)  # the gathered stream on dim 1
    assert torch.equal(to_natural(x), torch.arange(24).view(1, 24))


def test_document_ids():
    assert document_ids(torch.tensor([0, 2, 2, 5]), 5).tolist() == [0, 0, 2, 2, 2]
