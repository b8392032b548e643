"""The ``sdpa`` kernel: torch's ``scaled_dot_product_attention`` on the gathered sequence with
Megatron's masks, a bias and dropout; packed documents through torch's varlen flash kernel or one
call per document; a window, sinks, the log-sum-exp and (on the CPU) MLA through the tiled engine.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..exchange.orders import host_bounds, host_lengths
from ..options import LSE_TILE, CallSite, flash_takes_head_dim, options_set
from .tiled import lse_attention
from .varlen import Documents, padded_varlen


def cpu_prefers_lse_kernel(q, v, attention_mask=None, attention_bias=None, dropout_p=0.0) -> bool:
    """Whether, on the CPU, the ``sdpa`` backend runs the tiled log-sum-exp kernel for what SDPA can
    only do with ``[s, s]`` scores: value heads of another size (its CPU flash kernel takes one head
    dim) and a mask / constant bias broadcast over the query rows (SDPA would expand it)."""
    if q.device.type != "cpu" or dropout_p:
        return False
    if q.shape[-1] != v.shape[-1]:
        return attention_bias is None or not attention_bias.requires_grad
    rows = [t for t in (attention_mask, attention_bias) if t is not None]
    return (
        bool(rows)
        and all(t.shape[-2] == 1 for t in rows)
        and not (attention_bias is not None and attention_bias.requires_grad)
    )


def _to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute(1, 2, 0, 3) if layout == "sbhd" else x.transpose(1, 2)


def _from_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute(2, 0, 1, 3) if layout == "sbhd" else x.transpose(1, 2)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    layout: str = "sbhd",
    attention_mask: Optional[torch.Tensor] = None,
    attention_bias: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqlens: Optional[torch.Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    heads: Optional[Tuple[int, int]] = None,
    max_seqlen: Optional[int] = None,
):
    """Scaled dot-product attention in ``layout``; zero-copy views in and out.  ``cu_seqlens``
    (packed documents, ``sbhd`` with b = 1): one SDPA call per document; ``seqlens``: real lengths
    inside padded slots (pad tokens: zero output).  ``window_size``, ``softmax_offset`` (``[hq]``
    sink logits), ``return_lse`` (then ``(out, lse)``) and, on the CPU, value heads of another size
    and row-broadcast masks run through :func:`ulysses_mcore.kernels.tiled.lse_attention` (memory
    ``O(s x tile)``).  ``heads``: the global query heads held (unused here)."""
    if options_set(window_size, softmax_offset, return_lse) or (
        cu_seqlens is None and cpu_prefers_lse_kernel(q, v, attention_mask, attention_bias, dropout_p)
    ):
        if dropout_p:
            raise ValueError("dropout_p > 0 does not combine with window_size / softmax_offset / return_lse")
        lse_kw = dict(attention_mask=attention_mask, attention_bias=attention_bias, cu_seqlens=cu_seqlens)
        lse_kw.update(window_size=window_size, softmax_offset=softmax_offset, return_lse=return_lse)
        return lse_attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, tile=_lse_tile(q), **lse_kw
        )
    if cu_seqlens is not None:
        return _sdpa_varlen(
            q,
            k,
            v,
            cu_seqlens,
            seqlens,
            causal=causal,
            softmax_scale=softmax_scale,
            dropout_p=dropout_p,
            max_seqlen=max_seqlen,
        )
    if attention_mask is None and attention_bias is None:
        gqa = q.shape[2] != k.shape[2]
        return sdpa_plain(
            q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, dropout_p=dropout_p, gqa=gqa
        )
    qb, kb, vb = (_to_bhsd(t, layout) for t in (q, k, v))
    mask = _sdpa_mask(attention_mask, attention_bias, causal, (qb.shape[2], kb.shape[2]), like=q)
    gqa = qb.shape[1] != kb.shape[1]
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=softmax_scale, enable_gqa=gqa
    )
    return _from_bhsd(out, layout)


def _lse_tile(q) -> Optional[int]:
    """Tiles for the log-sum-exp kernel: on CUDA none where the flash kernel takes the call whole
    (windows through its own arguments; the ring engine tiles by itself what it cannot fuse), on
    the CPU ``LSE_TILE`` tokens (its flash kernel has no window)."""
    return None if q.device.type == "cuda" else LSE_TILE


def _sdpa_mask(attention_mask, attention_bias, causal: bool, lengths: Tuple[int, int], like: torch.Tensor):
    """SDPA's ``attn_mask`` from Megatron's mask (True = masked), an additive bias and causality, for
    ``lengths = (queries, keys)``, in ``like``'s dtype and on its device."""
    (S, Sk), dtype, device = lengths, like.dtype, like.device
    allowed = None if attention_mask is None else ~attention_mask.to(torch.bool)
    if causal:
        tri = torch.ones(S, Sk, dtype=torch.bool, device=device).tril()
        allowed = tri if allowed is None else allowed & tri
    if attention_bias is None:
        return allowed
    bias = attention_bias.to(dtype)
    return bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))


def sdpa_plain(q, k, v, *, causal, softmax_scale=None, layout="sbhd", dropout_p=0.0, gqa=False, heads=None):
    """SDPA without masks, bias or variants: two permuted views in, one out (``heads``: unused)."""
    out = F.scaled_dot_product_attention(
        _to_bhsd(q, layout),
        _to_bhsd(k, layout),
        _to_bhsd(v, layout),
        dropout_p=dropout_p,
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=gqa,
    )
    return _from_bhsd(out, layout)


def plain_sdpa_kernel(site: CallSite, q, v, gqa: bool, layout: str):
    """:func:`sdpa_plain` with the site's keywords bound, when a call has nothing that needs
    :func:`sdpa_attention`'s routing (a window, the lse, value heads of another size on the CPU),
    else ``None``."""
    if site.backend != "sdpa" or site.window is not None or site.return_lse:
        return None
    if q.device.type == "cpu" and q.shape[-1] != v.shape[-1]:
        return None
    return functools.partial(
        sdpa_plain,
        causal=site.causal,
        softmax_scale=site.softmax_scale,
        layout=layout,
        dropout_p=site.dropout_p or 0.0,
        gqa=gqa,
    )


def _sdpa_varlen(q, k, v, cu_seqlens, seqlens, *, causal, softmax_scale, dropout_p, max_seqlen=None):
    """Packed documents through SDPA: on a GPU in half precision, torch's own varlen flash kernel
    (device boundaries, ``max_seqlen`` from the host: no sync); else one SDPA call per document,
    the boundaries read on the host once per micro-batch (:data:`ulysses_mcore.exchange.orders.host_bounds`)."""
    if not dropout_p and torch_varlen_applies(q, v):
        return _torch_varlen(
            q, k, v, cu_seqlens, seqlens, causal=causal, softmax_scale=softmax_scale, max_seqlen=max_seqlen
        )
    bounds = host_bounds(cu_seqlens)
    real = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])] if seqlens is None else host_lengths(seqlens)
    outs = []
    for lo, hi, n in zip(bounds[:-1], bounds[1:], real):
        if n > 0:
            outs.append(
                sdpa_attention(
                    q[lo : lo + n],
                    k[lo : lo + n],
                    v[lo : lo + n],
                    causal=causal,
                    softmax_scale=softmax_scale,
                    dropout_p=dropout_p,
                )
            )
        if hi - lo > n:  # the pad after the document: no query, no key
            outs.append(q.new_zeros((hi - lo - n, *q.shape[1:])))
    return torch.cat(outs, dim=0)


_TORCH_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None


def torch_varlen_applies(q, v) -> bool:
    """Whether torch's varlen flash kernel (``torch.nn.attention.varlen``) takes this call: CUDA,
    fp16/bf16, one head dim of at most 256."""
    return (
        _TORCH_VARLEN
        and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == v.shape[-1]
        and flash_takes_head_dim(q.shape[-1])
    )


def _torch_varlen(q, k, v, cu_seqlens, seqlens, *, causal, softmax_scale, max_seqlen):
    from torch.nn.attention.varlen import varlen_attn  # torch builds without it: only where _TORCH_VARLEN

    kw = dict(scale=softmax_scale)
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:  # torch 2.9-2.11 spell causality is_causal; later ones as a window
        kw["is_causal"] = causal
    else:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    if q.shape[2] != k.shape[2]:
        if "enable_gqa" not in params:
            k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
        else:
            kw["enable_gqa"] = True
    return padded_varlen(varlen_attn, kw, (q, k, v), Documents(cu_seqlens, seqlens, max_seqlen))
