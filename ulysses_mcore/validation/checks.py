"""The checks one rank runs on its own call, before the ranks compare records
(:mod:`ulysses_mcore.validation.record`): each check returns the first problem of one concern, or "";
they run in the order of :data:`LOCAL_CHECKS` and the first problem wins.  A check reads the call
by name: ``c.opts`` (the :class:`~ulysses_mcore.options.CallSite`'s options), ``c.t`` (the
per-call :class:`~ulysses_mcore.options.CallTensors`), ``c.site.checked(name)`` (the caller's own
checks), ``c.degree`` / ``c.ring``.  Never a collective, never a raise: the caller writes the
problem into this rank's record.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake

from ..exchange.heads import LAYOUTS, head_layout_error, is_even, overlap_error, seq_dim
from ..exchange.orders import TOKEN_ORDERS
from ..options import (
    CallSite,
    CallTensors,
    backend_error,
    callable_accepts,
    callable_option_error,
    flash_head_dim_problem,
    flash_problem,
    options_set,
)


def int_list(t) -> Optional[Tuple[int, ...]]:
    """A 1-D integer tensor's values on the host (the first call of a signature only), ``UNREAD``
    for each entry of a tensor without values, ``None`` for anything else."""
    if t is None or not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
        return None
    if not has_values(t):  # a fake / meta tensor: its length stands for it, its values are unknowable
        return (UNREAD,) * t.shape[0]
    return tuple(t.detach().to("cpu", torch.int64).tolist())  # first call of a signature only


UNREAD = -1  # a boundary of a tensor without values (fake / meta): the value checks pass over it


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values the host can read: not a fake tensor (``FakeTensorMode``, the dry
    run's cluster-size model) and not on the meta device."""
    return t.device.type != "meta" and not is_fake(t)


def _known(vals: Tuple[int, ...]) -> bool:
    return UNREAD not in vals


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


class CallView:
    """One rank's call as the checks read it: the tensors, the site's options (``opts``), the
    per-call data (``t``), the caller's checks (``site.checked``), the degrees -- all by name."""

    def __init__(self, qkv, site: CallSite, tensors: CallTensors, sizes: Tuple[int, int]):
        self.q, self.k, self.v = qkv
        self.site, self.opts, self.t = site, site, tensors
        self.ulysses, self.ring = sizes
        self.layout, self.backend = self.opts.layout, self.opts.backend
        self.thd = self.layout == "thd"
        self.names = "[t, h, d]" if self.thd else f"[{','.join(str(self.layout))}]"

    @property
    def hdim(self) -> int:
        return self.q.dim() - 2

    @property
    def mla(self) -> bool:
        return self.v.shape[-1] != self.q.shape[-1]


# --- each check: the first problem of one concern, or "" (run in this order, first problem wins)
def _flags_problem(c: CallView) -> str:
    if not isinstance(c.layout, str) or c.layout not in LAYOUTS + ("thd",):
        return f"layout={c.layout!r} is unknown: use 'sbhd' ([s, b, h, d], Megatron's), 'bshd' or 'thd' (packed)"
    if not isinstance(c.opts.causal, bool):
        return f"causal must be True or False, got {c.opts.causal!r}"
    return backend_error(c.backend) or ""  # unknown, or not installed here


def _tensor_problem(c: CallView) -> str:
    want = 3 if c.thd else 4
    for name, t in (("query", c.q), ("key", c.k), ("value", c.v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if not t.is_floating_point():
            return f"{name} must be a floating-point tensor, got {_dtype(t)}"
        if t.dim() != want:
            hint = (
                " (for [s, b, h, d] use layout='sbhd')"
                if c.thd
                else (" (packed [t, h, d]: layout='thd')" if t.dim() == 3 else "")
            )
            return f"{name} must be a {want}-D {c.names} tensor for layout={c.layout!r}; it is {t.dim()}-D{hint}"
    q, k, v = c.q, c.k, c.v
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        return (
            f"query, key and value must share one dtype; they are {', '.join(_dtype(t) for t in (q, k, v))}: "
            "cast them to one dtype"
        )
    if len({q.device.type, k.device.type, v.device.type}) > 1:
        return (
            f"query, key and value must be on one device; they are on {q.device.type}, {k.device.type}, "
            f"{v.device.type}: move them to one device"
        )
    return ""


def _shape_problem(c: CallView) -> str:
    q, k, v, sdim, hdim = c.q, c.k, c.v, seq_dim(c.layout), c.hdim
    for dim, what in [(sdim, "sequence size")] + ([] if c.thd else [(1 - sdim, "batch size")]):
        vals = (q.shape[dim], k.shape[dim], v.shape[dim])
        if len(set(vals)) > 1:
            return f"query, key and value disagree in {what} (dim {dim} of {c.names}): {vals[0]}, {vals[1]}, {vals[2]}"
    if q.shape[-1] != k.shape[-1]:
        return (
            f"query and key disagree in head dim (dim {hdim + 1} of {c.names}): {q.shape[-1]}, {k.shape[-1]} "
            f"(value's may differ, as in multi-latent attention; query's and key's must match)"
        )
    if c.backend == "flash" and flash_head_dim_problem(q.shape[-1], v.shape[-1]):
        return flash_head_dim_problem(q.shape[-1], v.shape[-1])
    if c.backend == "flash" and backend_error("flash") is None:
        why = flash_problem(bool(c.opts.dropout_p), c.mla)
        if why:
            return f"backend='flash' (value head dim {v.shape[-1]}, query/key {q.shape[-1]}): {why}"
    if k.shape[hdim] != v.shape[hdim]:
        return f"key and value must have the same number of heads: {k.shape[hdim]} and {v.shape[hdim]}"
    if q.shape[sdim] < 1:
        return "the sequence shard is empty (length 0): every rank needs at least one token"
    return ""


def _heads_problem(c: CallView) -> str:
    hq, hk = c.q.shape[c.hdim], c.k.shape[c.hdim]
    expected = c.site.checked("expected_heads")
    if expected is not None and (hq, hk) != expected:
        return (
            f"the module was built for {expected[0]} query / {expected[1]} kv heads per tensor-parallel rank "
            f"but got {hq} / {hk}: build it with the model's config"
        )
    err = head_layout_error(hq, hk, c.ulysses)
    return f"{err} (heads are dim {c.hdim} of {c.names})" if err else ""


def _overlap_problem(c: CallView) -> str:
    chunks, ulysses = c.opts.overlap_chunks, c.ulysses
    if ulysses <= 1 or (isinstance(chunks, int) and chunks == 1):
        return ""
    if chunks != 1 and (c.mla or c.opts.return_lse):
        return (
            f"overlap_chunks={chunks} takes one head dim and no return_lse: use overlap_chunks=1 with "
            "value heads of another size or return_lse=True"
        )
    hq, hk = c.q.shape[c.hdim], c.k.shape[c.hdim]
    if not is_even(hq, hk, ulysses):
        return f"overlap_chunks={chunks} needs heads that divide evenly over the degree {ulysses}"
    return overlap_error(hq, hk, ulysses, chunks) or ""


def _mask_problem(c: CallView) -> str:
    for name in ("attention_mask", "attention_bias"):
        t = getattr(c.t, name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor or None, got {type(t).__name__}"
        if name == "attention_mask" and t.dtype != torch.bool:
            return (
                f"attention_mask must be a bool tensor (True = masked, Megatron's convention), got {_dtype(t)}: "
                "pass mask.bool() if 1 means masked, ~mask.bool() if 1 means keep"
            )
        if name == "attention_bias" and not t.is_floating_point():
            return f"attention_bias must be floating point (added to the scores), got {_dtype(t)}"
        if c.thd:
            return (
                f"layout='thd' takes no {name}: documents are separated by cu_seqlens; "
                "unpack to 'sbhd' for arbitrary masks"
            )
    return ""


def _scalar_problem(c: CallView) -> str:
    scale, p = c.opts.softmax_scale, c.opts.dropout_p
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        return f"softmax_scale must be a finite number or None, got {scale!r}"
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        return f"dropout_p must be a number in [0, 1], got {p!r}"
    if c.opts.token_order not in TOKEN_ORDERS:
        return f"token_order={c.opts.token_order!r} is unknown: use one of {list(TOKEN_ORDERS)}"
    return ""


def _window_value_problem(c: CallView) -> str:
    window = c.opts.window_size
    if window is not None and not (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in window)
    ):
        return (
            f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), got {window!r}: "
            "e.g. window_size=(4096, 0) for causal sliding-window attention"
        )
    return ""


def _sinks_value_problem(c: CallView) -> str:
    """Attention sinks and the log-sum-exp flag: their values."""
    offset, lse = c.t.softmax_offset, c.opts.return_lse
    if offset is not None:
        if not isinstance(offset, torch.Tensor) or not offset.is_floating_point() or offset.dim() != 1:
            what = (
                type(offset).__name__
                if not isinstance(offset, torch.Tensor)
                else f"a {offset.dim()}-D {_dtype(offset)} tensor"
            )
            return f"softmax_offset must be a 1-D floating-point tensor of one sink logit per query head, got {what}"
        if offset.shape[0] != c.q.shape[-2]:
            return (
                f"softmax_offset has {offset.shape[0]} entries but query has {c.q.shape[-2]} heads: one sink "
                "logit per query head (of this tensor-parallel rank)"
            )
        if offset.device.type != c.q.device.type:
            return f"softmax_offset is on {offset.device.type} but query on {c.q.device.type}: move it to one device"
    if not isinstance(lse, bool):
        return f"return_lse must be True or False, got {lse!r}"
    return ""


def _variant_support_problem(c: CallView) -> str:
    """Which kernels take the variants in use."""
    backend = c.backend
    wants = options_set(c.opts.window_size, c.t.softmax_offset, c.opts.return_lse)
    if not wants:
        return ""
    if callable(backend):
        missing = [n for n in wants if not callable_accepts(backend, n)]
        return callable_option_error(missing[0]) if missing else ""
    if backend in ("flash", "te"):
        other = [n for n in wants if n != "window_size"]
        if other:
            return (
                f"{other[0]} is not available with backend={backend!r} (it has the window only): "
                "use backend='sdpa' (the tiled log-sum-exp kernel) or a callable that takes it"
            )
        if backend == "te" and c.ring > 1:
            return (
                "window_size with a ring runs with backend='sdpa' (the log-sum-exp ring skips blocks outside "
                "the window), not with Transformer Engine's p2p ring"
            )
        return ""
    return _lse_kernel_problem(c, wants[0])


def _lse_kernel_problem(c: CallView, want: str) -> str:
    """backend='sdpa' with a variant: the tiled log-sum-exp kernel's limits."""
    if c.opts.dropout_p:
        return f"dropout_p={c.opts.dropout_p} does not combine with {want} (backend='sdpa'): set dropout_p=0"
    bias = c.t.attention_bias
    if isinstance(bias, torch.Tensor) and bias.requires_grad:
        return (
            f"attention_bias requires grad, but with {want} the kernel treats the bias as a constant: "
            "pass attention_bias.detach()"
        )
    if c.t.seqlens is not None:
        return (
            f"{want} does not combine with padding between packed documents (seqlens / "
            "cu_seqlens_q_padded) on backend='sdpa': pack documents tight (cu_seqlens only)"
        )
    return ""


def _packing_flags_problem(c: CallView) -> str:
    """Packed sequences asked for consistently (Megatron's record, cu_seqlens, the layout)."""
    fmt, cu = c.t.qkv_format, c.t.cu_seqlens
    if fmt not in (None, "thd"):
        return f"packed_seq_params.qkv_format={fmt!r}: packed sequences are supported in 'thd' format only"
    if fmt == "thd" and cu is None:
        return (
            "packed_seq_params needs cu_seqlens_q (global document boundaries of the packed stream); build it "
            "with ulysses_mcore.megatron.layer.batch.packed_seq_params()"
        )
    if cu is not None and not c.thd:
        return f"cu_seqlens is given but layout={c.layout!r}: pass layout='thd' for packed sequences"
    if not c.thd and c.opts.token_order == "per_document":
        return "token_order='per_document' is for packed input (layout='thd' with cu_seqlens)"
    if c.thd and cu is None:
        return "layout='thd' needs cu_seqlens (the global document boundaries of the packed stream)"
    if c.thd and callable(c.backend):
        return "layout='thd' needs backend='sdpa', 'flash' or 'te' (varlen kernels), not a callable"
    return ""


def _boundaries_problem(c: CallView) -> str:
    """The packed stream's document boundaries (``cu_seqlens``, ``cu_seqlens_kv``)."""
    if not c.thd:
        return ""
    cu = c.t.cu_seqlens
    vals = int_list(cu)
    if vals is None or len(vals) < 2:
        return "cu_seqlens must be a 1-D integer tensor [documents + 1]"
    if not _known(vals):
        return ""
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        return (
            f"cu_seqlens must start at 0 and never decrease (it starts at {vals[0]}): give the cumulative "
            "document lengths of the whole packed stream"
        )
    total = c.q.shape[0] * c.ulysses * c.ring
    if vals[-1] != total:
        return (
            f"cu_seqlens ends at {vals[-1]}, but the packed stream is {total} tokens ({c.q.shape[0]} per rank x "
            f"{c.ulysses * c.ring} ranks): cu_seqlens must cover the whole global stream; pad the stream to a "
            "multiple of the degree with a last document"
        )
    kv = c.t.cu_seqlens_kv
    if kv is not None and kv is not cu and int_list(kv) != vals:
        return (
            "cu_seqlens_kv must equal cu_seqlens_q for self-attention; build the batch with "
            "ulysses_mcore.megatron.layer.batch.packed_seq_params()"
        )
    return ""


def _seqlens_problem(c: CallView) -> str:
    """Real document lengths inside padded slots (``seqlens``), against the boundaries."""
    if not c.thd or c.t.seqlens is None:
        return ""
    vals = int_list(c.t.cu_seqlens)
    real = int_list(c.t.seqlens)
    if real is None or len(real) != len(vals) - 1:
        return f"seqlens (real document lengths) must be a 1-D integer tensor of {len(vals) - 1} entries"
    if not (_known(vals) and _known(real)):
        return ""
    if any(n < 0 or n > b - a for n, a, b in zip(real, vals, vals[1:])):
        return "seqlens: every real document length must be between 0 and its padded length (cu_seqlens)"
    return ""


def _per_document_problem(c: CallView) -> str:
    if not c.thd or c.opts.token_order != "per_document":
        return ""
    need = 2 * c.ulysses * c.ring
    if c.ring > 1:
        return (
            "token_order='per_document' (Transformer Engine's THD layout) does not combine with a ring: "
            "shard the packed stream with token_order='load_balanced' instead"
        )
    vals = int_list(c.t.cu_seqlens)
    if _known(vals) and any((b - a) % need for a, b in zip(vals, vals[1:])):
        return (
            f"token_order='per_document' deals every document out in {need} chunks, so every (padded) "
            f"document length must be a multiple of {need}: pad the documents (cu_seqlens_padded), or "
            "shard the stream whole with token_order='load_balanced'"
        )
    return ""


LOCAL_CHECKS = (
    _flags_problem,
    _tensor_problem,
    _shape_problem,
    _heads_problem,
    _overlap_problem,
    _mask_problem,
    _scalar_problem,
    _window_value_problem,
    _sinks_value_problem,
    _variant_support_problem,
    _packing_flags_problem,
    _boundaries_problem,
    _seqlens_problem,
    _per_document_problem,
)


def local_problem(call: CallView) -> str:
    """What is wrong with this rank's inputs alone ("" if nothing): the first problem of the checks."""
    for check in LOCAL_CHECKS:
        problem = check(call)
        if problem:
            return problem
    return ""
