"""The two records of an attention call, what each kernel can take, and the constants every room
shares.

:class:`CallSite`: what stays the same from call to call at one call site -- the options the ranks
compare (:data:`OPTIONS`) and where it runs (groups, first head, the caller's checks and kernel,
the check mode); built when the site's first signature is prepared.  :class:`CallTensors`: what
changes per call (masks, bias, boundaries, sinks), its fields' treatment one table
(:data:`PER_CALL`).  What a kernel can take is data here too, so validation reads it without
importing a kernel.  Adding an option: a :class:`CallSite` field and its name in :data:`OPTIONS`
(and in :meth:`CallSite.kernel_keywords`), its check in :mod:`ulysses_mcore.validation.checks`,
the kernels that implement it.  Values are stored as given (a bad one is the validator's to report).
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch

LSE_TILE = 512  # tokens per tile of the log-sum-exp kernel: scores held at once are [b, h, 512, 512]
FLASH_HEAD_DIM_STEP, FLASH_MAX_HEAD_DIM = 8, 256  # the flash kernels' head dims (torch's and flash-attn's)


def flash_takes_head_dim(d: int) -> bool:
    """Whether the flash kernels (torch's CUDA flash / varlen, flash-attn) take head dim ``d``:
    a multiple of 8, at most 256."""
    return d % FLASH_HEAD_DIM_STEP == 0 and d <= FLASH_MAX_HEAD_DIM


VARIANT_OPTIONS = ("window_size", "softmax_offset", "return_lse")


def has_window(window_size) -> bool:
    return window_size is not None and tuple(window_size) != (-1, -1)


def options_set(window_size=None, softmax_offset=None, return_lse=False) -> list:
    """The names of the variant options in use (a window of (-1, -1) is none), in ``VARIANT_OPTIONS`` order."""
    on = (has_window(window_size), softmax_offset is not None, return_lse is not None and return_lse is not False)
    return [name for name, used in zip(VARIANT_OPTIONS, on) if used]


BUILTIN_BACKENDS = ("sdpa", "flash", "te")


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


OPTIONS = (  # a call site's options: what the math is, compared across the ranks field by field
    "causal",
    "layout",
    "backend",
    "softmax_scale",
    "dropout_p",
    "token_order",
    "overlap_chunks",
    "window_size",
    "return_lse",
)


@dataclass(frozen=True)
class CallSite:
    """Everything fixed at one call site, resolved once; hashable (part of a prepared call's key).
    The options (:data:`OPTIONS`): ``causal``; ``layout`` "sbhd" | "bshd" | "thd"; ``backend``
    "sdpa" | "flash" | "te" | a callable; ``softmax_scale`` (None: 1/sqrt(d)); ``dropout_p``;
    ``token_order`` "contiguous" | "load_balanced" | "per_document"; ``overlap_chunks``;
    ``window_size`` (left, right), -1 unbounded; ``return_lse``.  Where it runs: ``group``,
    ``ring_group``, ``first_head`` (the model's index of the first query head here), ``checks`` (the
    caller's ``(name, value)`` pairs), ``kernel`` (the caller's kernel object), ``check`` (``True``,
    ``False``, ``"every_call"``)."""

    causal: bool
    layout: str = "sbhd"
    backend: Union[str, Callable] = "sdpa"
    softmax_scale: Optional[float] = None
    dropout_p: float = 0.0
    token_order: str = "contiguous"
    overlap_chunks: int = 1
    window_size: Optional[Tuple[int, int]] = None
    return_lse: bool = False
    group: Any = None
    ring_group: Any = None
    first_head: int = 0
    checks: Tuple[Tuple[str, Any], ...] = ()
    kernel: Any = None
    check: Union[bool, str] = True

    @property
    def window(self) -> Optional[Tuple[int, int]]:
        """The window in force, or ``None`` (``(-1, -1)`` is none)."""
        return tuple(self.window_size) if has_window(self.window_size) else None

    def kernel_keywords(self, layout: str) -> dict:
        """The keywords every kernel call of this site takes (the ones in use only: a kernel that
        lacks an option it is not asked for still runs)."""
        kw = dict(causal=self.causal, softmax_scale=self.softmax_scale, layout=layout)
        if self.dropout_p:
            kw["dropout_p"] = self.dropout_p
        if self.window is not None:
            kw["window_size"] = self.window
        if self.return_lse:
            kw["return_lse"] = True
        return kw

    def checked(self, name: str, default=None):
        """The caller's check ``name``, or ``default``."""
        return dict(self.checks).get(name, default)


_SITE_FIELDS = tuple(f.name for f in fields(CallSite))


def call_site(causal, **choices) -> CallSite:
    """The :class:`CallSite` of ``causal`` and the other fields by name, the values as given
    (``causal=1`` or ``dropout_p=False`` reach the validator as they are, not as ``True`` / ``0.0``);
    a ``window_size`` list becomes a tuple.  Built when a call site's first signature is prepared."""
    unknown = set(choices) - set(_SITE_FIELDS)
    if unknown:
        raise TypeError(f"call_site: unknown field(s) {sorted(unknown)}; the fields: {list(_SITE_FIELDS)}")
    if isinstance(choices.get("window_size"), list):
        choices["window_size"] = tuple(choices["window_size"])
    return CallSite(causal, **choices)


class CallTensors(NamedTuple):
    """The per-call data beside the options: tensors that change from call to call (and the
    packed-sequence record's format), read by name everywhere."""

    attention_mask: Any = None
    attention_bias: Any = None
    cu_seqlens: Any = None
    seqlens: Any = None
    softmax_offset: Any = None
    max_seqlen: Optional[int] = None  # the longest packed document (or a bound), a host int: not in the key
    cu_seqlens_kv: Any = None  # Megatron's packed-sequence record: checked against cu_seqlens
    qkv_format: Optional[str] = None  # Megatron's packed-sequence record's format ("thd")


NO_TENSORS = CallTensors()


class PerCall(NamedTuple):
    """How one per-call field is treated: its part of a prepared call's key (``"tensor"``: shape,
    dtype, device, requires_grad; ``"boundaries"``: dtype and device only, a new batch's documents
    are not a new signature; ``"value"``: as it is; None: not keyed), how the ranks compare it
    (``"sig"``: presence, shape, dtype, requires_grad; ``"values"``: every value; None: not compared)
    and what a disagreement is called."""

    key: Optional[str]
    compared: Optional[str] = None
    called: str = ""


PER_CALL = {  # the one table of CallTensors' fields, in their order
    "attention_mask": PerCall("tensor", "sig", "attention_mask (presence, shape, dtype)"),
    "attention_bias": PerCall("tensor", "sig", "attention_bias (presence, shape, dtype, requires_grad)"),
    "cu_seqlens": PerCall(
        "boundaries", "values", "cu_seqlens (the global document boundaries must be identical on every rank)"
    ),
    "seqlens": PerCall("boundaries", "values", "seqlens (real document lengths must be identical on every rank)"),
    "softmax_offset": PerCall("tensor", "sig", "softmax_offset (presence, shape, dtype, requires_grad)"),
    "max_seqlen": PerCall(None),  # a host bound: neither keyed nor compared
    "cu_seqlens_kv": PerCall("boundaries"),  # Megatron's record: checked against cu_seqlens, not compared
    "qkv_format": PerCall("value"),
}


__all__ = [
    "OPTIONS",
    "CallSite",
    "CallTensors",
    "NO_TENSORS",
    "call_site",
    "has_window",
    "options_set",
    "LSE_TILE",
    "VARIANT_OPTIONS",
]
