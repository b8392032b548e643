"""The ``te`` backend: Transformer Engine's ``DotProductAttention`` on the gathered sequence (its
own context parallelism off, or over the ring group for the hybrid), one module per shape, kept by
the prepared call that uses it.  Import-guarded: Transformer Engine is imported when a module is built."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from .varlen import kernel_window, varlen_args


def te_mask_type(causal: bool, packed: bool, mask_shape=None) -> Tuple[str, bool]:
    """``(attn_mask_type, fold)`` for Transformer Engine (``fold``: causality folded into the mask).
    Packed documents and key-padding masks ``[b|1, 1, 1, s]``: TE's padding types; a full
    ``[b|1, h|1, s, s]`` mask: ``"arbitrary"`` with causality folded in (TE's unfused kernel: use
    ``sdpa`` for such masks at length); no mask: ``causal`` / ``no_mask``."""
    if packed or (mask_shape is not None and mask_shape[-2] == 1):
        return ("padding_causal" if causal else "padding"), False
    if mask_shape is not None:
        return "arbitrary", causal
    return ("causal" if causal else "no_mask"), False


def _te_mask(mask, causal: bool):
    """The mask TE gets for ``te_mask_type``'s ``"arbitrary"``: causality folded in (True = masked)."""
    S, Sk = mask.shape[-2], mask.shape[-1]
    upper = torch.ones(S, Sk, dtype=torch.bool, device=mask.device).triu(1)
    return mask.to(torch.bool) | upper


class TEAttention(torch.nn.Module):
    """Transformer Engine's ``DotProductAttention`` for the heads one rank holds after the exchange,
    built once: as a child of :class:`~ulysses_mcore.megatron.layer.module.UlyssesAttention` (its layer
    number, its own FP8 metadata, its state in the model's state dict and checkpoints), or held by
    the functional API's prepared call (:class:`TEKernel`).  With ``ring_group``, TE's own p2p ring
    over it (the input is this rank's dual-chunk ring shard, which TE's load-balanced context
    parallelism expects).  The format, mask type and window of each call go to TE's forward."""

    def __init__(self, heads, kv_heads, d, dv, *, softmax_scale, dropout_p=0.0, layer_number=None, ring_group=None):
        super().__init__()
        import transformer_engine.pytorch as te  # optional (CUDA only): imported when a module is built

        kw = dict(layer_number=layer_number) if layer_number is not None else {}
        self.inner = te.DotProductAttention(
            num_attention_heads=heads,
            kv_channels=d if d == dv else (d, dv),  # MLA: value heads of another size
            num_gqa_groups=kv_heads,
            attention_dropout=dropout_p,
            qkv_format="sbhd",
            attn_mask_type="causal",
            softmax_scale=softmax_scale,
            **kw,
        )
        if ring_group is not None:
            self.inner.set_context_parallel_group(
                ring_group, dist.get_process_group_ranks(ring_group), torch.cuda.Stream(), "p2p"
            )

    def forward(self, q, k, v, *, causal, softmax_scale=None, layout="sbhd", dropout_p=0.0, **kw):
        return te_call(self.inner, q, k, v, causal=causal, layout=layout, **kw)


def te_call(mod, q, k, v, *, causal, layout="sbhd", **kw):
    """One call of a TE ``DotProductAttention`` with this call's format, mask type and window."""
    mask, bias, cu = kw.get("attention_mask"), kw.get("attention_bias"), kw.get("cu_seqlens")
    hq, dv = q.shape[2], v.shape[3]
    mask_type, fold = te_mask_type(causal, cu is not None, None if mask is None else tuple(mask.shape))
    call = dict(attn_mask_type=mask_type, window_size=kernel_window(kw, none=None))
    if bias is not None:
        call.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    if cu is None:
        call.update(qkv_format=layout, attention_mask=_te_mask(mask, causal) if fold else mask)
        return mod(q, k, v, **call).view(*q.shape[:2], hq, dv)
    cu32, maxlen = varlen_args(cu, q.device, kw.get("max_seqlen"))
    lens = kw.get("seqlens")
    if lens is not None:  # TE's own padded-THD form: real cu_seqlens + padded offsets
        real = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(device=q.device, dtype=torch.int32)
        call.update(cu_seqlens_q_padded=cu32, cu_seqlens_kv_padded=cu32)
        cu32 = real
    call.update(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=maxlen, max_seqlen_kv=maxlen)
    return mod(q[:, 0], k[:, 0], v[:, 0], **call).view(q.shape[0], 1, hq, dv)


class TEKernel:
    """Transformer Engine as a kernel (the registry's ``"te"``, what ``ulysses_attention(backend="te")``
    runs): the :class:`TEAttention` modules of whoever resolved it -- a prepared call: one per head
    shape it meets (its heads, or its head chunks under overlap) -- built on first use and released
    with it.  Inside a
    Megatron model each ``UlyssesAttention`` owns its own instead.  ``ring_group``: TE's p2p ring."""

    def __init__(self, ring_group=None):
        self.ring_group, self.modules = ring_group, {}

    def __call__(self, q, k, v, *, causal, softmax_scale=None, layout="sbhd", dropout_p=0.0, **kw):
        shape = (q.shape[2], k.shape[2], q.shape[3], v.shape[3])
        mod = self.modules.get(shape)
        if mod is None:
            mod = self.modules[shape] = TEAttention(
                *shape, softmax_scale=softmax_scale, dropout_p=dropout_p, ring_group=self.ring_group
            ).to(q.device)
        return mod(q, k, v, causal=causal, layout=layout, **kw)
