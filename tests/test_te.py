"""The Transformer Engine backend (ulysses_mcore.kernels.te): the mask type TE takes, and what its
DotProductAttention receives (TE stands in as a recorder: it cannot be installed without CUDA)."""

import pytest
import torch

from ulysses_mcore.kernels import te


@pytest.mark.parametrize(
    "causal,packed,mask_shape,want",
    [
        (True, False, None, ("causal", False)),
        (False, False, None, ("no_mask", False)),
        (True, True, None, ("padding_causal", False)),
        (False, True, None, ("padding", False)),
        (True, False, (2, 1, 1, 16), ("padding_causal", False)),  # key padding: TE's lengths
        (False, False, (2, 1, 1, 16), ("padding", False)),
        (True, False, (2, 1, 16, 16), ("arbitrary", True)),  # a full mask: causality folded in
        (False, False, (1, 4, 16, 16), ("arbitrary", False)),
    ],
)
def test_te_mask_type(causal, packed, mask_shape, want):
    assert te.te_mask_type(causal, packed, mask_shape) == want


def test_te_call_arguments():
    """What a TE DotProductAttention receives: the format, the mask type, the folded mask, and for
    packed input int32 boundaries, padded offsets and the caller's max_seqlen."""
    calls = []

    def te_mod(q, k, v, **kw):
        calls.append((q.shape, kw))
        return torch.zeros(*q.shape[:-1], v.shape[-1])

    q = torch.randn(16, 2, 4, 8)
    mask = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    te.te_call(te_mod, q, q, q, causal=True, attention_mask=mask)
    shape, kw = calls[-1]
    assert kw["attn_mask_type"] == "arbitrary" and kw["qkv_format"] == "sbhd"
    assert torch.equal(kw["attention_mask"][0, 0], torch.ones(16, 16, dtype=torch.bool).triu(1))
    te.te_call(te_mod, q, q, q, causal=True)
    assert calls[-1][1]["attn_mask_type"] == "causal" and calls[-1][1]["attention_mask"] is None
    p = torch.randn(24, 1, 4, 8)
    cu, lens = torch.tensor([0, 8, 20, 24]), torch.tensor([5, 11, 3])
    out = te.te_call(te_mod, p, p, p, causal=True, cu_seqlens=cu, seqlens=lens, max_seqlen=12)
    shape, kw = calls[-1]
    assert shape == (24, 4, 8) and out.shape == (24, 1, 4, 8)
    assert kw["qkv_format"] == "thd" and kw["attn_mask_type"] == "padding_causal"
    assert kw["cu_seqlens_q"].tolist() == [0, 5, 16, 19] and kw["cu_seqlens_q_padded"].tolist() == [0, 8, 20, 24]
    assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == 12 and kw["cu_seqlens_q"].dtype == torch.int32


def test_the_functional_api_keeps_its_te_modules_in_the_prepared_call(monkeypatch):
    """ulysses_attention(backend="te"): the prepared call of a signature holds its Transformer Engine
    module, built on its first call for the heads the rank holds (a stand-in with TE's keywords:
    TE needs CUDA) and reused after; another signature gets its own; release() lets both go.
    The outputs equal float64 attention of the whole sequence."""
    import torch.distributed as dist

    import ulysses_mcore
    from ulysses_mcore.attention import CALLS
    from tests.helpers import reference_attention, run_threaded, te_stand_in

    built = te_stand_in(monkeypatch)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, 2, h, 8, generator=g) for h in (4, 2, 2))
    ulysses_mcore.release()

    def fn(rank, world):
        shard = [t.chunk(world)[rank] for t in (q, k, v)]
        outs = [ulysses_mcore.ulysses_attention(*shard, group=dist.group.WORLD, causal=True, backend="te")]
        outs.append(ulysses_mcore.ulysses_attention(*shard, group=dist.group.WORLD, causal=True, backend="te"))
        half = [t[:, :1] for t in shard]  # another signature: its own prepared call and module
        ulysses_mcore.ulysses_attention(*half, group=dist.group.WORLD, causal=True, backend="te")
        return outs

    res = run_threaded(2, fn)
    assert len(built) == 4 and {(kw["num_attention_heads"], kw["num_gqa_groups"]) for kw in built} == {(2, 1)}
    held = [m for c in CALLS.entries.values() for m in c.kernel.modules.values()]
    assert len(held) == 4 and sum(len(m.inner.calls) for m in held) == 6
    ref = reference_attention(q.double(), k.double(), v.double(), causal=True)
    for i in range(2):
        out = torch.cat([r[i] for r in res])
        assert (out.double() - ref).abs().max() < 1e-5
    ulysses_mcore.release()
    assert not CALLS.entries
