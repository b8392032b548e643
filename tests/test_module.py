"""UlyssesAttention: Megatron-Core's core_attention contract, against float64 attention."""

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from ulysses_mcore import UlyssesAttention
from tests.helpers import reference_attention, run_threaded, run_threaded_errors, te_stand_in


def config(heads=8, groups=2, hidden=64, dropout=0.0, **kw):
    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=dropout,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        **kw,
    )


def run_module(P, mask_type, use_mask=False, use_bias=False, heads=8, groups=2, S=16, b=2):
    cfg = config(heads, groups)
    d = cfg.kv_channels
    g = torch.Generator().manual_seed(7)
    q = torch.randn(S, b, heads, d, generator=g)
    k = torch.randn(S, b, groups, d, generator=g)
    v = torch.randn(S, b, groups, d, generator=g)
    dout = torch.randn(S, b, heads * d, generator=g)
    mask = (torch.rand(b, 1, S, S, generator=g) < 0.3) if use_mask else None
    bias = torch.randn(1, heads, S, S, generator=g) if use_bias else None

    def rank_fn(rank, world):
        mod = UlyssesAttention(
            cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self", ulysses_group=dist.group.WORLD
        )
        qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
        out = mod(qs, ks, vs, mask, attn_mask_type=mask_type, attention_bias=bias)
        assert out.shape == (S // world, b, heads * d)
        out.backward(dout.chunk(world)[rank])
        return out.detach(), qs.grad, ks.grad, vs.grad

    got = [torch.cat(x) for x in zip(*run_threaded(P, rank_fn))]
    causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
    ref_mask = None if mask_type in (AttnMaskType.causal, AttnMaskType.no_mask) else mask
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, attention_mask=ref_mask, attention_bias=bias)
    ref = ref.reshape(S, b, -1)
    ref.backward(dout.double())
    for a, r in zip(got, (ref, qr.grad, kr.grad, vr.grad)):
        err = (a.double() - r).abs().max() / r.abs().max()
        assert err < 1e-5, err


@pytest.mark.parametrize(
    "mask_type,use_mask,use_bias",
    [
        (AttnMaskType.causal, True, False),  # a causal mask given is ignored, as in TE
        (AttnMaskType.no_mask, False, False),
        (AttnMaskType.padding, True, False),
        (AttnMaskType.padding_causal, True, True),
        (AttnMaskType.arbitrary, True, False),
    ],
)
def test_module_matches_reference(mask_type, use_mask, use_bias):
    run_module(4, mask_type, use_mask, use_bias)


def test_uneven_heads_in_the_module():
    run_module(4, AttnMaskType.causal, heads=7, groups=7, S=16)
    run_module(4, AttnMaskType.padding_causal, use_mask=True, heads=12, groups=3, S=16)


def test_two_models_keep_their_own_heads():
    """Head counts are per instance (DeepSpeed #8291): two differently shaped modules in one process."""
    run_module(2, AttnMaskType.causal, heads=8, groups=8)
    run_module(2, AttnMaskType.causal, heads=4, groups=1)

    def rank_fn(rank, world):
        a = UlyssesAttention(config(8, 2), 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)
        b = UlyssesAttention(config(4, 4, hidden=32), 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)
        return (a.num_q_heads, a.num_kv_heads), (b.num_q_heads, b.num_kv_heads)

    assert run_threaded(2, rank_fn)[0] == ((8, 2), (4, 4))


def test_dropout_applies_in_training_only():
    cfg = config(4, 4, hidden=32, dropout=1.0)  # p = 1 drops everything: output is exactly 0

    def rank_fn(rank, world):
        mod = UlyssesAttention(cfg, 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)
        x = torch.randn(4, 1, 4, 8)
        train = mod(x, x, x, None)
        mod.eval()
        evald = mod(x, x, x, None)
        return train.abs().max().item(), evald.abs().max().item()

    for train, evald in run_threaded(2, rank_fn):
        assert train == 0.0 and evald > 0.0


def test_construction_errors_name_the_flag():
    def rank_fn(rank, world):
        UlyssesAttention(config(3, 3, hidden=48), 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)

    errs = run_threaded_errors(4, rank_fn)
    assert all(
        isinstance(e, ValueError) and "--ulysses-degree 4" in str(e) and "--num-attention-heads 3" in str(e)
        for e in errs
    ), errs

    def packed(rank, world):
        mod = UlyssesAttention(config(4, 4, hidden=32), 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)
        x = torch.randn(4, 1, 4, 8)
        from megatron.core.packed_seq_params import PackedSeqParams

        mod(x, x, x, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))

    errs = run_threaded_errors(2, packed)
    assert all(isinstance(e, ValueError) and "'thd' format only" in str(e) for e in errs), errs

    def ring_mismatch(rank, world):  # Megatron's CP size 4 but only a Ulysses group of 2 and no ring
        UlyssesAttention(
            config(4, 4, hidden=32, context_parallel_size=4), 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD
        )

    errs = run_threaded_errors(2, ring_mismatch)
    assert all(isinstance(e, ValueError) and "--ulysses-degree x --context-parallel-size" in str(e) for e in errs), errs


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("mask_type", [AttnMaskType.padding_causal, AttnMaskType.padding])
def test_megatron_per_document_thd_layout(P, mask_type):
    """Megatron-LM / TE's THD batches with padding between documents (cu_seqlens_q real,
    cu_seqlens_q_padded padded; at P > 1 every document padded to 2 x CP and dealt out in dual
    chunks per document): exact on every row -- pads are neither queries nor keys (zero output,
    zero gradient) although their output gradient is not zero."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ulysses_mcore.megatron.layer.batch import document_mask

    heads, d = 4, 8
    real = [5, 11, 3]  # document lengths
    padded = [8, 12, 4]  # each padded to a multiple of 2P = 4
    cu_pad = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    cu_real = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    T = int(cu_pad[-1])
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(T, heads, d, generator=g) for _ in range(4))

    def te_shard(t, r):  # chunks r and 2P-1-r of every padded document, documents in order
        parts = []
        for lo, n in zip(cu_pad[:-1].tolist(), padded):
            c = n // (2 * P)
            parts += [t[lo + r * c : lo + (r + 1) * c], t[lo + (2 * P - 1 - r) * c : lo + (2 * P - r) * c]]
        return torch.cat(parts)

    def rank_fn(rank, world):
        mod = UlyssesAttention(
            config(heads, heads, hidden=heads * d, context_parallel_size=P),
            1,
            mask_type,
            ulysses_group=dist.group.WORLD,
        )
        qs, ks, vs = (te_shard(t, rank).clone().requires_grad_() for t in (q, k, v))
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_real,
            cu_seqlens_kv=cu_real,
            cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad,
        )
        out = mod(qs, ks, vs, None, packed_seq_params=psp)
        out.backward(te_shard(dout, rank).reshape(out.shape))
        return out.detach().view(-1, heads, d), qs.grad, ks.grad, vs.grad

    res = run_threaded(P, rank_fn)
    is_real = torch.zeros(T, dtype=torch.bool)
    for lo, n in zip(cu_pad[:-1].tolist(), real):
        is_real[lo : lo + n] = True
    mask = document_mask(cu_pad, T) | ~is_real[None, None, None, :] | ~is_real[None, None, :, None]
    qr, kr, vr = (t.double().unsqueeze(1).requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=mask_type == AttnMaskType.padding_causal, attention_mask=mask)
    ref.backward(dout.double().unsqueeze(1))
    for i, want in enumerate((ref.detach(), qr.grad, kr.grad, vr.grad)):
        want = want.squeeze(1)
        got = torch.zeros_like(want)
        for r in range(P):  # scatter each rank's shard back to its natural positions
            idx = te_shard(torch.arange(T), r)
            got[idx] = res[r][i].double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (i, err)
        assert got[~is_real].abs().max() == 0  # pads: no output, no gradient


def test_module_refuses_heads_it_was_not_built_for():
    """Built for 4 query / 2 kv heads per rank, handed 8: the same ValueError on every rank."""
    cfg = config(4, 2, hidden=32)

    def fn(rank, world):
        mod = UlyssesAttention(cfg, 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)
        q = torch.randn(4, 1, 8, cfg.kv_channels)
        k = torch.randn(4, 1, 2, cfg.kv_channels)
        mod(q, k, k, None)

    errs = run_threaded_errors(2, fn)
    assert all(isinstance(e, ValueError) and "built for 4 query / 2 kv heads" in str(e) for e in errs), errs


@pytest.mark.parametrize("layer,softmax_type", [(1, "off-by-one"), (2, "learnable"), (3, "learnable")])
def test_module_variants_from_megatron_config(layer, softmax_type):
    """window_size / window_attn_skip_freq / softmax_type from Megatron's config: layers 1 and 3 of
    window_attn_skip_freq=2 run the window, layer 2 full attention (Megatron's rule); the sinks are
    a zero buffer (off-by-one) or the module's own parameter (learnable), whose gradient, summed over
    the Ulysses ranks, is the float64 one."""
    cfg = config(8, 2, window_size=(3, 0), window_attn_skip_freq=2, softmax_type=softmax_type)
    d, S, b = cfg.kv_channels, 16, 2
    g = torch.Generator().manual_seed(layer)
    q, k, v = (
        torch.randn(S, b, 8, d, generator=g),
        torch.randn(S, b, 2, d, generator=g),
        torch.randn(S, b, 2, d, generator=g),
    )
    dout = torch.randn(S, b, 8 * d, generator=g)

    def rank_fn(rank, world):
        mod = UlyssesAttention(
            cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal, ulysses_group=dist.group.WORLD
        )
        qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
        mod(qs, ks, vs, None).backward(dout.chunk(world)[rank])
        sinks = mod.softmax_offset
        return (
            qs.grad,
            ks.grad,
            vs.grad,
            sinks.detach().clone(),
            sinks.grad if sinks.requires_grad else None,
            mod.window_size,
            [n for n, _ in mod.named_parameters()],
        )

    res = run_threaded(4, rank_fn)
    window = res[0][5]
    assert window == (None if layer == 2 else (3, 0))
    assert res[0][6] == (["softmax_offset"] if softmax_type == "learnable" else [])
    sinks = res[0][3]
    if softmax_type == "off-by-one":
        assert torch.equal(sinks, torch.zeros(8))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    sr = sinks.double().requires_grad_()
    ref = reference_attention(qr, kr, vr, causal=True, window_size=window, softmax_offset=sr).reshape(S, b, -1)
    ref.backward(dout.double())
    got = [torch.cat([r[i] for r in res]) for i in range(3)]
    for a, r in zip(got, (qr.grad, kr.grad, vr.grad)):
        assert (a.double() - r).abs().max() / r.abs().max() < 1e-5
    if softmax_type == "learnable":
        ds = sum(r[4] for r in res)
        assert (ds.double() - sr.grad).abs().max() / sr.grad.abs().max() < 1e-5


def test_module_rejects_unknown_softmax_type():
    def rank_fn(rank, world):
        cfg = config(8, 2)
        cfg.softmax_type = "sigmoid"
        UlyssesAttention(cfg, 1, AttnMaskType.causal, ulysses_group=dist.group.WORLD)

    errs = run_threaded_errors(2, rank_fn)
    assert all("config.softmax_type='sigmoid' is unknown" in str(e) for e in errs), errs


def test_te_attention_is_a_child_built_once_per_module(monkeypatch):
    """backend='te': each UlyssesAttention builds its Transformer Engine attention once, at
    construction, for the heads its rank holds after the exchange and with its layer number, as a
    child module whose state is in the module's state dict.  TE needs CUDA, so a stand-in with
    TE's constructor and forward keywords computes the attention (SDPA) here; the outputs must
    still equal float64 attention of the whole sequence (the wiring of heads and format)."""
    built = te_stand_in(monkeypatch)
    cfg = config(8, 2)
    d, S, b = cfg.kv_channels, 16, 2
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(S, b, h, d, generator=g) for h in (8, 2, 2))

    def fn(rank, world):
        mods = [
            UlyssesAttention(cfg, n, AttnMaskType.causal, ulysses_group=dist.group.WORLD, backend="te") for n in (1, 3)
        ]
        outs = [m(*(t.chunk(world)[rank] for t in (q, k, v)), None) for m in mods for _ in range(2)]
        states = [sorted(m.state_dict()) for m in mods]
        return outs[0], [len(m.te_attention.inner.calls) for m in mods], states

    res = run_threaded(2, fn)
    assert len(built) == 4  # 2 modules x 2 ranks, at construction: none at forward
    assert {(kw["num_attention_heads"], kw["num_gqa_groups"], kw["layer_number"]) for kw in built} == {
        (4, 1, 1),
        (4, 1, 3),
    }
    for _out, calls, states in res:
        assert calls == [2, 2] and states[0] == ["te_attention.inner.fp8_meta"]
    ref = reference_attention(q.double(), k.double(), v.double(), causal=True).reshape(S, b, -1)
    assert (torch.cat([r[0] for r in res]).double() - ref).abs().max() < 1e-5
