"""RoPE after the all-to-all, for ``--dynamic-ulysses`` (a Ulysses degree per document).

A cell's share on one rank is a contiguous piece of its documents, which Megatron's RoPE (sliced
by its fixed context-parallel group) cannot place; after the exchange every token of the cell is on
the rank, at its position in its document (from ``cu_seqlens``, on the device), and Megatron's own
RoPE function rotates q and k there.  :class:`DynamicOptions` is what a ``UlyssesAttention`` of the
dynamic path is built with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ulysses_mcore.megatron.layer.batch import document_positions


@dataclass(frozen=True)
class DynamicOptions:
    """What a ``UlyssesAttention`` of ``--dynamic-ulysses`` needs: the largest degree (its heads are
    checked against every power of two up to it) and whether it applies RoPE (after the exchange)."""

    max_ulysses: int
    rope: bool = True


class RotaryKernel:
    """An attention kernel with Megatron's RoPE applied to q and k first, each token at its position
    in its document (``cu_seqlens`` of the full stream the exchange delivered: no host read)."""

    def __init__(self, inner, config):
        self.inner, self.config = inner, config
        self.rotary = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=dist.group.WORLD,  # read only to slice a sequence over a fixed group: a packed table never is
        )

    def __call__(self, q, k, v, *, cu_seqlens=None, **kw):
        total = q.shape[0]
        freqs = self.rotary(total, packed_seq=True)[document_positions(cu_seqlens, total)]
        # Megatron's public RoPE with one frequency row per token (its [s, b, h, d] path); the group
        # is read only by its fused packed-sequence path, which a per-token table never takes
        q = apply_rotary_pos_emb(q, freqs, self.config, cp_group=dist.group.WORLD)
        k = apply_rotary_pos_emb(k, freqs, self.config, cp_group=dist.group.WORLD)
        return self.inner(q, k, v, cu_seqlens=cu_seqlens, **kw)


__all__ = ["DynamicOptions", "RotaryKernel"]
