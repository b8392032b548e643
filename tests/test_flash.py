"""The flash backend (ulysses_mcore.kernels.flash): which flash-attn runs a call, and what each receives
(flash-attn itself stands in as a recorder: it cannot be installed without CUDA)."""

import pytest
import torch

from ulysses_mcore import options
from ulysses_mcore.kernels import flash


@pytest.mark.parametrize(
    "fa2,fa3,dropout,mla,want",
    [
        (True, True, False, False, "fa3"),
        (True, True, True, False, "fa2"),  # flash-attn 3 has no dropout
        (False, True, False, True, "fa3"),  # MLA: flash-attn 3 only
        (True, False, False, True, None),
        (False, True, True, False, None),
        (True, True, True, True, None),
        (True, False, False, False, "fa2"),
    ],
)
def test_flash_choice(fa2, fa3, dropout, mla, want):
    which, why = options.flash_choice(fa2, fa3, dropout=dropout, mla=mla)
    assert which == want and (bool(why) == (want is None))
    if want is None:
        assert ("dropout" in why) if dropout else ("flash-attn 3" in why)


class _Recorder:
    """A stand-in for flash-attn's functions that records its arguments and returns zeros."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *args, **kw):
        self.calls.append((args, kw, q.shape))
        return torch.zeros(*q.shape[:-1], v.shape[-1])


@pytest.mark.parametrize("which", ["fa2", "fa3"])
def test_flash_calls_get_their_own_arguments(monkeypatch, which):
    """flash-attn 3 never receives dropout_p (it has none); varlen calls get int32 boundaries and the
    caller's max_seqlen; padded documents run as interleaved (real, pad) sequences and pad rows come
    back zero -- nothing read on the host."""
    dense, varlen = _Recorder(), _Recorder()
    monkeypatch.setattr(flash, "flash_installed", lambda: (which == "fa2", True))
    monkeypatch.setattr(flash, "_flash_functions", lambda w: (dense, varlen))
    q = torch.randn(24, 1, 4, 8)
    flash.flash_attention(q, q, q, causal=True, softmax_scale=0.5, dropout_p=0.1 if which == "fa2" else 0.0)
    args, kw, shape = dense.calls[-1]
    assert shape == (1, 24, 4, 8) and kw["causal"] and kw["softmax_scale"] == 0.5
    assert ("dropout_p" in kw) == (which == "fa2")
    cu, lens = torch.tensor([0, 8, 20, 24]), torch.tensor([5, 11, 3])
    out = flash.flash_attention(q, q, q, causal=True, cu_seqlens=cu, seqlens=lens, max_seqlen=12)
    args, kw, shape = varlen.calls[-1]
    assert shape == (24, 4, 8) and args[0].dtype == torch.int32 and args[2] == args[3] == 12
    assert args[0].tolist() == [0, 5, 8, 19, 20, 23, 24]
    assert out.shape == (24, 1, 4, 8)
