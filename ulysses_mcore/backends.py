"""Inner attention kernels, run on the gathered sequence for this rank's heads.

Every kernel takes ``q [S, b, hq, d]`` (``sbhd``) or ``[b, S, hq, d]`` (``bshd``) and
``k, v`` with ``hk`` heads (``hq % hk == 0``: grouped-query attention is the kernel's
job), and returns the output in the same layout.  Nothing here knows about ranks.

* ``sdpa``  -- ``torch.nn.functional.scaled_dot_product_attention``: CPU and GPU, masks,
  additive bias, dropout.
* ``flash`` -- flash-attn 2/3 ``flash_attn_func`` (CUDA, fp16/bf16, causal or none).
* ``te``    -- Transformer Engine ``DotProductAttention`` with its own context
  parallelism off (CUDA).
* any callable ``(q, k, v, *, causal, softmax_scale) -> out``; one that declares ``heads``
  receives the global ``(first, last + 1)`` query heads it holds (to index its own per-head
  parameters), and ``window_size`` / ``softmax_offset`` / ``return_lse`` when it declares them.

Megatron's mask convention is kept: a boolean ``attention_mask`` is True where attention
is *not* allowed, broadcastable to ``[b, hq, S, S]``.  A query row with no allowed key
gives a zero output row (torch's convention).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .options import (
    FLASH_HEAD_DIM_STEP,
    FLASH_MAX_HEAD_DIM,
    LSE_TILE,
    VARIANT_OPTIONS,
    AttentionOptions,
    flash_takes_head_dim,
    has_window,
    options_set,
)
from .orders import document_ids, host_bounds, host_lengths
from .ring import ring_attention

BUILTIN_BACKENDS = ("sdpa", "flash", "te")
Kernel = Callable[..., torch.Tensor]


def _kernel_window(kw, none=(-1, -1)):
    """The window a flash / TE kernel takes: ``kw["window_size"]`` as a tuple, or ``none``."""
    return tuple(kw["window_size"]) if has_window(kw.get("window_size")) else none


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
    """Scaled dot-product attention in ``layout``; zero-copy views in and out.

    ``cu_seqlens`` (packed documents, ``sbhd`` with b = 1): one SDPA call per document, so
    memory follows the longest document, never the whole stream squared.  ``seqlens``: real
    lengths inside padded slots; pad tokens are neither queries nor keys (zero output).

    What SDPA cannot express -- ``window_size=(left, right)``, ``softmax_offset`` (per-head sink
    logits, ``[hq]`` of the heads given here), ``return_lse`` (then ``(out, lse)``) -- and, on the
    CPU, value heads of another size and masks / biases broadcast over the query rows (SDPA would
    hold ``[s, s]`` scores for them) run through the tiled log-sum-exp kernel
    (:func:`ulysses_mcore.ring.ring_attention` without a ring): exact, memory ``O(s x tile)``,
    tiles outside the window skipped.  ``heads``: the global query heads held (unused here)."""
    if options_set(window_size, softmax_offset, return_lse) or (
        cu_seqlens is None and cpu_prefers_lse_kernel(q, v, attention_mask, attention_bias, dropout_p)
    ):
        if dropout_p:
            raise ValueError("dropout_p > 0 does not combine with window_size / softmax_offset / return_lse")
        lse_kw = dict(attention_mask=attention_mask, attention_bias=attention_bias, cu_seqlens=cu_seqlens)
        lse_kw.update(window_size=window_size, softmax_offset=softmax_offset, return_lse=return_lse)
        return ring_attention(
            q, k, v, group=None, causal=causal, softmax_scale=softmax_scale, layout=layout, tile=_lse_tile(q), **lse_kw
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
    mask = _sdpa_mask(attention_mask, attention_bias, causal, qb.shape[2], kb.shape[2], q.dtype, q.device)
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


def _sdpa_mask(attention_mask, attention_bias, causal: bool, S: int, Sk: int, dtype, device):
    """SDPA's ``attn_mask`` from Megatron's mask (True = masked), an additive bias and causality."""
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


def plain_sdpa_kernel(opts: AttentionOptions, q, v, gqa: bool, layout: str):
    """:func:`sdpa_plain` with ``opts``' keywords bound, when a call has nothing that needs
    :func:`sdpa_attention`'s routing (a window, the lse, value heads of another size on the CPU),
    else ``None``."""
    if opts.backend != "sdpa" or opts.window is not None or opts.return_lse:
        return None
    if q.device.type == "cpu" and q.shape[-1] != v.shape[-1]:
        return None
    return functools.partial(
        sdpa_plain,
        causal=opts.causal,
        softmax_scale=opts.softmax_scale,
        layout=layout,
        dropout_p=opts.dropout_p or 0.0,
        gqa=gqa,
    )


def _sdpa_varlen(q, k, v, cu_seqlens, seqlens, *, causal, softmax_scale, dropout_p, max_seqlen=None):
    """Packed documents through SDPA: on a GPU in half precision, torch's own varlen flash kernel
    (device boundaries, ``max_seqlen`` from the host: no sync); else one SDPA call per document,
    the boundaries read on the host once per micro-batch (:data:`ulysses_mcore.orders.host_bounds`)."""
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
    from torch.nn.attention.varlen import varlen_attn

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
    return _flash_varlen(varlen_attn, kw, q, k, v, cu_seqlens, seqlens, max_seqlen)


def interleaved_boundaries(cu_seqlens: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """Padded documents as a varlen kernel can run them without reading anything on the host:
    ``[c0, c0+l0, c1, c1+l1, ..., cn]`` -- each document's real tokens one sequence, its pad
    another (attending only to itself; its rows are zeroed afterwards)."""
    cu = cu_seqlens.to(torch.int64)
    lens = seqlens.to(device=cu.device, dtype=torch.int64)
    pairs = torch.stack([cu[:-1], cu[:-1] + lens], dim=1).reshape(-1)
    return torch.cat([pairs, cu[-1:]])


def real_token_rows(cu_seqlens: torch.Tensor, seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` bool: which positions of the padded stream are real tokens (device-side)."""
    cu = cu_seqlens.to(torch.int64)
    doc = document_ids(cu, total)
    lens = seqlens.to(device=cu.device, dtype=torch.int64)
    return torch.arange(total, device=cu.device) - cu[doc] < lens[doc]


def _varlen_args(cu_seqlens, device, max_seqlen=None):
    """(int32 cu_seqlens on ``device``, longest document) for the varlen kernels: ``max_seqlen``
    from the caller (Megatron's ``PackedSeqParams.max_seqlen_q``, a bound is enough), else read
    off the boundaries (a device-to-host sync on a GPU)."""
    if max_seqlen is None:
        bounds = host_bounds(cu_seqlens)
        max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return cu_seqlens.to(device=device, dtype=torch.int32), int(max_seqlen)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flash_choice(fa2: bool, fa3: bool, *, dropout: bool, mla: bool) -> Tuple[Optional[str], str]:
    """Which flash-attn runs a call: ``("fa3" | "fa2", "")``, or ``(None, why)``.  flash-attn 3
    (``flash_attn_interface``, Hopper) is preferred; it has no dropout, so dropout needs flash-attn 2;
    value heads of another size (MLA) need flash-attn 3 (flash-attn 2 takes one head dim)."""
    if fa3 and not dropout:
        return "fa3", ""
    if fa2 and not mla:
        return "fa2", ""
    if dropout and mla:
        return None, "attention dropout with value heads of another size (MLA): no flash-attn kernel has both"
    if dropout:
        return None, (
            "attention dropout needs flash-attn 2 (flash-attn 3 has no dropout): pip install flash-attn, "
            "set --attention-dropout 0, or use backend='sdpa' / 'te'"
        )
    return None, (
        "value heads of another size than query/key heads (multi-latent attention) need flash-attn 3: "
        "install it, or use backend='sdpa' / 'te'"
    )


def flash_installed() -> Tuple[bool, bool]:
    """(flash-attn 2 importable, flash-attn 3 importable)."""
    return _installed("flash_attn"), _installed("flash_attn_interface")


def flash_head_dim_problem(d: int, dv: int) -> str:
    """Why flash-attn's kernels cannot take these head dims ("" if they can)."""
    bad = [x for x in dict.fromkeys((d, dv)) if not flash_takes_head_dim(x)]
    if not bad:
        return ""
    return (
        f"backend='flash' takes head dims that are multiples of {FLASH_HEAD_DIM_STEP} up to {FLASH_MAX_HEAD_DIM} "
        f"(query/key {d}, value {dv}): use backend='sdpa' or 'te', or a head dim such as "
        f"{min(FLASH_MAX_HEAD_DIM, -(-bad[0] // FLASH_HEAD_DIM_STEP) * FLASH_HEAD_DIM_STEP)}"
    )


def flash_problem(dropout: bool, mla: bool) -> str:
    """Why backend='flash' cannot run a call with these options here ("" if it can)."""
    return flash_choice(*flash_installed(), dropout=dropout, mla=mla)[1]


def _flash_functions(which: str):
    """(dense, varlen) functions of flash-attn 2 or 3."""
    if which == "fa3":
        import flash_attn_interface as fa
    else:
        import flash_attn as fa
    return fa.flash_attn_func, fa.flash_attn_varlen_func


def flash_call_args(which: str, dropout_p: float, softmax_scale, causal: bool, window) -> dict:
    """The keywords of a flash-attn call: flash-attn 3 takes no ``dropout_p`` (never passed)."""
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window)
    if which == "fa2":
        kw["dropout_p"] = dropout_p
    return kw


def _first(out):
    return out[0] if isinstance(out, tuple) else out  # flash-attn 3 may return (out, lse)


def flash_attention(q, k, v, *, causal, softmax_scale=None, layout="sbhd", dropout_p=0.0, **kw):
    """flash-attn's ``flash_attn_func`` (bshd, GQA native); ``flash_attn_varlen_func`` for
    packed documents (``cu_seqlens``).  flash-attn 3 where installed, 2 for dropout
    (:func:`flash_choice`)."""
    if kw.get("attention_mask") is not None or kw.get("attention_bias") is not None:
        raise ValueError(
            "backend='flash' supports causal or no mask only; got an attention_mask or "
            "attention_bias: use backend='sdpa' (or 'te') for masks and bias"
        )
    which, why = flash_choice(*flash_installed(), dropout=bool(dropout_p), mla=q.shape[-1] != v.shape[-1])
    if which is None:
        raise ValueError(f"backend='flash': {why}")
    dense, varlen = _flash_functions(which)
    args = flash_call_args(which, dropout_p, softmax_scale, causal, _kernel_window(kw))
    cu = kw.get("cu_seqlens")
    if cu is not None:
        return _flash_varlen(varlen, args, q, k, v, cu, kw.get("seqlens"), kw.get("max_seqlen"))
    to_bshd = (lambda t: t.transpose(0, 1)) if layout == "sbhd" else (lambda t: t)
    return to_bshd(_first(dense(to_bshd(q), to_bshd(k), to_bshd(v), **args)))


def _flash_varlen(varlen, args, q, k, v, cu, seqlens, max_seqlen):
    """Packed documents (``[t, 1, h, d]``); with ``seqlens`` (documents padded in their slots) each
    pad runs as a sequence of its own and its rows are zeroed: nothing is read on the host."""
    bounds = cu if seqlens is None else interleaved_boundaries(cu, seqlens)
    cu32, maxlen = _varlen_args(bounds, q.device, max_seqlen)
    out = _first(varlen(q[:, 0], k[:, 0], v[:, 0], cu32, cu32, maxlen, maxlen, **args)).unsqueeze(1)
    if seqlens is None:
        return out
    real = real_token_rows(cu, seqlens, q.shape[0])[:, None, None, None]
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))


def te_mask_type(causal: bool, packed: bool, mask_shape=None) -> Tuple[str, bool]:
    """``(attn_mask_type, fold)`` for Transformer Engine: ``fold`` = causality must be folded into
    the mask itself.  Packed documents: TE's padding types with ``cu_seqlens``.  A key-padding mask
    ``[b|1, 1, 1, s]``: the padding types (TE turns it into per-sequence lengths, so padding sits at
    the end of each sequence, Megatron's convention).  A full ``[b|1, h|1, s, s]`` mask:
    ``"arbitrary"`` with causality folded in (TE has no causal variant of an arbitrary mask; it runs
    its unfused kernel: use ``sdpa`` for such masks at length).  No mask: ``causal`` / ``no_mask``
    (TE's flash and fused kernels)."""
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
    number, its own FP8 metadata, its state in the model's state dict and checkpoints), or cached
    per shape for the functional API.  With ``ring_group``, TE's own p2p ring over it (the input is
    this rank's dual-chunk ring shard, which TE's load-balanced context parallelism expects).  The
    format, mask type and window of each call go to TE's forward."""

    def __init__(self, heads, kv_heads, d, dv, *, softmax_scale, dropout_p=0.0, layer_number=None, ring_group=None):
        super().__init__()
        import transformer_engine.pytorch as te

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
            import torch.distributed as dist

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
    call = dict(attn_mask_type=mask_type, window_size=_kernel_window(kw, none=None))
    if bias is not None:
        call.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    if cu is None:
        call.update(qkv_format=layout, attention_mask=_te_mask(mask, causal) if fold else mask)
        return mod(q, k, v, **call).view(*q.shape[:2], hq, dv)
    cu32, maxlen = _varlen_args(cu, q.device, kw.get("max_seqlen"))
    lens = kw.get("seqlens")
    if lens is not None:  # TE's own padded-THD form: real cu_seqlens + padded offsets
        real = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(device=q.device, dtype=torch.int32)
        call.update(cu_seqlens_q_padded=cu32, cu_seqlens_kv_padded=cu32)
        cu32 = real
    call.update(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=maxlen, max_seqlen_kv=maxlen)
    return mod(q[:, 0], k[:, 0], v[:, 0], **call).view(q.shape[0], 1, hq, dv)


_TE_CACHE: dict = {}  # the functional API's TE modules by (heads, dims, scale, dropout, device, ring)
_TE_CACHE_MAX = 32


def te_attention(q, k, v, *, causal, softmax_scale=None, layout="sbhd", dropout_p=0.0, **kw):
    """Transformer Engine for the functional API (``ulysses_attention(backend="te")``): one
    :class:`TEAttention` per head shape, scale, dropout, device and ring, cached (bounded).  Inside
    a Megatron model each ``UlyssesAttention`` owns its own instead."""
    ring = kw.pop("ring_group", None)
    key = (q.shape[2], k.shape[2], q.shape[3], v.shape[3], softmax_scale, dropout_p, q.device, ring)
    mod = _TE_CACHE.get(key)
    if mod is None:
        if len(_TE_CACHE) >= _TE_CACHE_MAX:  # bounded: shapes seen once (evaluation, odd batches) do not pile up
            _TE_CACHE.clear()
        mod = _TE_CACHE[key] = TEAttention(
            *key[:4], softmax_scale=softmax_scale, dropout_p=dropout_p, ring_group=ring
        ).to(q.device)
    return mod(q, k, v, causal=causal, layout=layout, **kw)


def is_installed(name: str) -> bool:
    if name == "sdpa":
        return True
    if name == "flash":
        return (
            importlib.util.find_spec("flash_attn") is not None
            or importlib.util.find_spec("flash_attn_interface") is not None
        ) and torch.cuda.is_available()
    if name == "te":
        return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
    return False


def backend_error(backend) -> Optional[str]:
    """Why ``backend`` cannot be used here, or ``None``."""
    if callable(backend):
        return None
    if backend not in BUILTIN_BACKENDS:
        return (
            f"backend={backend!r} is unknown: use one of {list(BUILTIN_BACKENDS)} or a callable "
            "(q, k, v, *, causal, softmax_scale) -> out"
        )
    if not is_installed(backend):
        extra = {"flash": "flash", "te": "te"}[backend]
        pkg = {"flash": "flash-attn", "te": "transformer-engine"}[backend]
        return (
            f"backend={backend!r} needs {pkg} and a CUDA GPU, which this process lacks: "
            f"pip install 'ulysses-mcore[{extra}]' on a GPU node, or use backend='sdpa'"
        )
    return None


def callable_accepts(fn, name: str) -> bool:
    """Whether a callable backend declares keyword ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def callable_option_error(name: str) -> str:
    return (
        f"{name} is set but the callable backend does not take a {name!r} keyword: declare it "
        f"(q, k, v, *, causal, softmax_scale, {name}, heads=None) or use backend='sdpa'"
    )


def resolve(backend: Union[str, Kernel]) -> Kernel:
    """The kernel for ``backend`` (call :func:`backend_error` first for a clean message)."""
    err = backend_error(backend)
    if err:
        raise ValueError(err)
    if callable(backend):
        user = backend

        def call_user(q, k, v, *, causal, softmax_scale=None, layout="sbhd", **kw):
            if any(kw.get(n) is not None for n in ("attention_mask", "attention_bias", "cu_seqlens")) or kw.get(
                "dropout_p"
            ):
                raise ValueError(
                    "a callable backend takes (q, k, v, *, causal, softmax_scale) only: "
                    "masks, bias and dropout need backend='sdpa' or 'te'"
                )
            extra = {}
            for name in options_set(*(kw.get(n) for n in VARIANT_OPTIONS)):
                if not callable_accepts(user, name):
                    raise ValueError(callable_option_error(name))
                extra[name] = kw[name]
            if kw.get("heads") is not None and callable_accepts(user, "heads"):
                extra["heads"] = kw["heads"]  # the global query heads this call holds
            return user(q, k, v, causal=causal, softmax_scale=softmax_scale, **extra)

        return call_user
    return {"sdpa": sdpa_attention, "flash": flash_attention, "te": te_attention}[backend]
