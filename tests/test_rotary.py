"""ulysses_mcore.megatron.layer.rotary: RoPE after the exchange rotates every token at its position
in its own document, as Megatron's RoPE does to each document on its own."""

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.helpers import run_threaded
from ulysses_mcore.megatron.layer.rotary import RotaryKernel


def test_each_document_is_rotated_from_position_zero():
    from ulysses_mcore.megatron.compat import cpu_compat

    cpu_compat.apply()  # Megatron's RotaryEmbedding asks torch.cuda for its device
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    seen = {}

    def inner(q, k, v, **kw):
        seen.update(q=q, k=k, kw=kw)
        return v

    cu = torch.tensor([0, 5, 12])
    q, k, v = (torch.randn(12, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    run_threaded(1, lambda rank, world: RotaryKernel(inner, cfg)(q, k, v, cu_seqlens=cu, causal=True))
    # reference: Megatron's RoPE applied to each document alone, positions 0 .. n-1
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)

    def alone(t, a, b):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t[a:b], rope(b - a).to(t.dtype), rotary_interleaved=False)

    for a, b in ((0, 5), (5, 12)):
        assert torch.allclose(seen["q"][a:b], alone(q, a, b), atol=1e-6)
        assert torch.allclose(seen["k"][a:b], alone(k, a, b), atol=1e-6)
    assert seen["kw"]["cu_seqlens"] is cu and seen["kw"]["causal"] is True
    assert not torch.allclose(seen["q"][5:7], q[5:7])  # position 0 is the identity, 1 is not
