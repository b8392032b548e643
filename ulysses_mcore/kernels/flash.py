"""The ``flash`` backend: flash-attn 3 (``flash_attn_interface``, Hopper) or 2 (``flash_attn``) on
the gathered sequence, dense or packed (varlen), CUDA fp16/bf16.  Import-guarded: nothing here
imports flash-attn until a call runs on it."""

from __future__ import annotations

from ..options import flash_choice, flash_installed
from .varlen import Documents, first_output, kernel_window, padded_varlen


def _flash_functions(which: str):
    """(dense, varlen) functions of flash-attn 2 or 3."""
    if which == "fa3":
        import flash_attn_interface as fa  # optional (CUDA only): imported on the first call that runs it
    else:
        import flash_attn as fa  # optional (CUDA only)
    return fa.flash_attn_func, fa.flash_attn_varlen_func


def flash_call_args(which: str, dropout_p: float, softmax_scale, causal: bool, window) -> dict:
    """The keywords of a flash-attn call: flash-attn 3 takes no ``dropout_p`` (never passed)."""
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window)
    if which == "fa2":
        kw["dropout_p"] = dropout_p
    return kw


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
    args = flash_call_args(which, dropout_p, softmax_scale, causal, kernel_window(kw))
    cu = kw.get("cu_seqlens")
    if cu is not None:
        return padded_varlen(varlen, args, (q, k, v), Documents(cu, kw.get("seqlens"), kw.get("max_seqlen")))
    to_bshd = (lambda t: t.transpose(0, 1)) if layout == "sbhd" else (lambda t: t)
    return to_bshd(first_output(dense(to_bshd(q), to_bshd(k), to_bshd(v), **args)))
