"""Batch sharding: a Megatron batch for the full sequence -> this rank's token shard.

Labels are shifted *before* sharding (``tokens = text[:-1]``, ``labels = text[1:]``, as
Megatron's GPTDataset does), so the last token of shard ``k`` keeps its label, the first
token of shard ``k+1``.  Positions stay global (``position_ids`` are sharded with the
tokens; Megatron slices RoPE the same way), so every shard sees its true positions.

Token order: Megatron's context-parallel (load-balanced, dual-chunk) order by default --
rank ``r`` of ``P`` holds chunks ``r`` and ``2P-1-r`` of ``2P`` -- which is what
Megatron-Core's RoPE slicing expects whenever ``context_parallel_size > 1``; or contiguous.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams

from ulysses_mcore.exchange.orders import document_ids

SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


# ----------------------------------------------------------------------------------
# Packed sequences (THD): documents separated by cu_seqlens instead of an [s, s] mask
# ----------------------------------------------------------------------------------
def document_boundaries(tokens: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """``cu_seqlens`` (int32) of a micro-batch ``tokens [b, s]`` read as one packed stream of
    ``b*s`` tokens: a document ends after each ``eod`` token and at each sample's end --
    Megatron-LM's ``--reset-attention-mask`` semantics, without the ``[s, s]`` mask."""
    b, s = tokens.shape
    ends = set()
    for i in range(b):
        eods = (tokens[i] == eod_token_id).nonzero().flatten().tolist()
        ends.update(i * s + e + 1 for e in eods)
        ends.add((i + 1) * s)
    return torch.tensor([0] + sorted(ends), dtype=torch.int32)


def document_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The dense equivalent ``[1, 1, total, total]`` (True = masked: different documents);
    what Megatron-LM builds for ``--reset-attention-mask``.  For references and small runs."""
    d = document_ids(cu_seqlens, total)
    return (d[:, None] != d[None, :])[None, None]


def packed_seq_params(cu_seqlens: torch.Tensor, total: Optional[int] = None):
    """Megatron's ``PackedSeqParams`` (``thd``) for a packed stream sharded over the
    context-parallel group in Megatron's dual-chunk order (documents cross shard boundaries).

    ``cu_seqlens_q/kv`` are the true document boundaries (what :class:`UlyssesAttention`
    reads).  ``cu_seqlens_*_padded = [0, total]`` and ``max_seqlen = total`` make
    Megatron's THD RoPE treat the stream as one sequence, so each token gets its
    stream position, sliced exactly like the tokens.  RoPE scores depend only on the
    *difference* of two positions, and attention never crosses a document, so this equals
    per-document positions (``--reset-position-ids``) exactly in real arithmetic."""
    cu = cu_seqlens.to(torch.int32)
    total = int(cu[-1]) if total is None else total
    whole = torch.tensor([0, total], dtype=torch.int32, device=cu.device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=whole,
        cu_seqlens_kv_padded=whole,
        max_seqlen_q=total,
        max_seqlen_kv=total,
    )


def document_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each token of a packed stream inside its own document (restarting at 0)."""
    return torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[document_ids(cu_seqlens, total)]


def reset_position_ids(batch: Dict[str, torch.Tensor], eod_token_id: int) -> Dict[str, torch.Tensor]:
    """``position_ids`` restarting after every ``eod`` token (Megatron-LM's
    ``--reset-position-ids``).  Only learned absolute embeddings read them: RoPE scores depend
    on position differences, which are the same within a document either way."""
    b, s = batch["tokens"].shape
    cu = document_boundaries(batch["tokens"], eod_token_id)  # sample ends are boundaries too
    return dict(batch, position_ids=document_positions(cu, b * s).view(b, s))


def pack_batch(
    batch: Dict[str, torch.Tensor], eod_token_id: int, *, reset_positions: bool = True
) -> Dict[str, torch.Tensor]:
    """A micro-batch ``[b, s]`` -> one packed stream ``[1, b*s]`` with ``cu_seqlens`` from
    the ``eod`` tokens and sample ends (no attention mask; positions restart per document
    unless ``reset_positions=False``)."""
    cu = document_boundaries(batch["tokens"], eod_token_id)
    out = {
        k: (v.reshape(1, -1) if k in SEQ_KEYS and v is not None else v)
        for k, v in batch.items()
        if k != "attention_mask"
    }
    if reset_positions:
        out["position_ids"] = document_positions(cu, out["tokens"].shape[1]).unsqueeze(0)
    out["cu_seqlens"] = cu
    return out


def make_lm_batch(text: torch.Tensor, *, pad_token_id: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """``text [b, s+1]`` -> tokens, labels (shifted), loss_mask, position_ids ``[b, s]``.

    Positions whose *label* is ``pad_token_id`` get ``loss_mask = 0``."""
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    loss_mask = torch.ones_like(tokens, dtype=torch.float)
    if pad_token_id is not None:
        loss_mask[labels == pad_token_id] = 0.0
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": pos}


def pad_batch(batch: Dict[str, torch.Tensor], multiple: int, *, pad_token_id: int = 0) -> Dict[str, torch.Tensor]:
    """Pad the sequence dim up to a multiple of ``multiple``; padding never changes the result:
    padded tokens come last (causal attention never lets a real token see them), their
    loss_mask is 0, and as keys they are masked in a given ``attention_mask``."""
    S = batch["tokens"].shape[1]
    extra = (-S) % multiple
    if extra == 0:
        return dict(batch)
    out = dict(batch)
    b = batch["tokens"].shape[0]
    for key in ("tokens", "labels"):
        if key in batch:
            out[key] = torch.cat([batch[key], batch[key].new_full((b, extra), pad_token_id)], dim=1)
    if "loss_mask" in batch:
        out["loss_mask"] = torch.cat([batch["loss_mask"], batch["loss_mask"].new_zeros(b, extra)], dim=1)
    if "position_ids" in batch:
        last = batch["position_ids"][:, -1:]
        step = torch.arange(1, extra + 1, device=last.device).unsqueeze(0)
        out["position_ids"] = torch.cat([batch["position_ids"], last + step], dim=1)
    cu = batch.get("cu_seqlens")
    if cu is not None:  # packed: the padding is one more (fully loss-masked) document
        out["cu_seqlens"] = torch.cat([cu, cu.new_tensor([S + extra])])
    m = batch.get("attention_mask")
    if m is not None:
        m = torch.nn.functional.pad(m, (0, extra, 0, extra), value=True)  # True = masked
        out["attention_mask"] = m
    return out


def shard_sequence(
    t: torch.Tensor, rank: int, ulysses: int, *, dim: int = 1, load_balanced: bool = True
) -> torch.Tensor:
    """This rank's share of ``t`` along ``dim`` (contiguous block, or chunks r and 2P-1-r)."""
    if ulysses == 1:
        return t
    S = t.shape[dim]
    parts = 2 * ulysses if load_balanced else ulysses
    if S % parts:
        raise ValueError(
            f"sequence length {S} is not divisible by {parts} "
            f"({'2 x ' if load_balanced else ''}the sequence-sharding degree {ulysses}): "
            f"pass pad_to_multiple_of={parts} (padding is masked) or change --seq-length"
        )
    chunks = t.chunk(parts, dim=dim)
    if not load_balanced:
        return chunks[rank].contiguous()
    return torch.cat([chunks[rank], chunks[2 * ulysses - 1 - rank]], dim=dim)


def shard_batch(
    batch: Dict[str, torch.Tensor],
    *,
    rank: Optional[int] = None,
    ulysses: Optional[int] = None,
    load_balanced: Optional[bool] = None,
    pad_to_multiple_of: Optional[int] = None,
    pad_token_id: int = 0,
) -> Dict[str, torch.Tensor]:
    """This rank's shard of a full-sequence Megatron batch.

    ``batch``: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[b, s]`` and
    optionally ``attention_mask [b|1, 1, s, s]`` (bool, True = masked), which stays whole:
    Ulysses attention sees the full sequence.  A packed batch (:func:`pack_batch`: b = 1,
    ``cu_seqlens``) is sharded as one stream and gets ``packed_seq_params``.  ``rank``/``ulysses``
    default to this rank's place in the sample group (Ulysses x ring cp, Megatron's CP group);
    ``load_balanced`` defaults to ``ulysses > 1``'s Megatron convention (True)."""
    if rank is None or ulysses is None:
        rank = ps.get_context_parallel_rank() if rank is None else rank
        ulysses = ps.get_context_parallel_world_size() if ulysses is None else ulysses
    if load_balanced is None:
        load_balanced = True
    if pad_to_multiple_of:
        batch = pad_batch(batch, pad_to_multiple_of, pad_token_id=pad_token_id)
    out = {}
    for key, val in batch.items():
        if key == "cu_seqlens":  # packed: the global boundaries stay whole, Megatron's params built here
            out["packed_seq_params"] = packed_seq_params(val, batch["tokens"].shape[1])
            continue
        if key in SEQ_KEYS and val is not None:
            out[key] = shard_sequence(val, rank, ulysses, dim=1, load_balanced=load_balanced)
        else:
            out[key] = val
    return out
