"""One record of the static choices of an attention call, and the constants every layer shares.

:class:`AttentionOptions` carries what stays the same from call to call at one call site --
causality, layout, kernel, scale, dropout, token order, overlap, window, whether the
log-sum-exp is returned -- so ``ulysses_attention``, the validator, the prepared call and
``UlyssesAttention`` pass one value instead of a dozen keywords.  It is built once per call
site: :func:`attention_options` returns the same (hashable) record for the same values, so the
functional API pays one dict lookup per call, and the record is itself part of the cache key of
a validated call.  Per-call tensors (masks, bias, document boundaries, sinks) are data, not
options: they travel beside the record.

The fields are typed as a valid call has them, but values are stored as given (a bad one is the
validator's to report, the same on every rank); only a ``window_size`` list becomes a tuple, so
the record stays hashable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

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


@dataclass(frozen=True)
class AttentionOptions:
    """The static choices of one attention call site (see the module docstring)."""

    causal: bool
    layout: str = "sbhd"  # "sbhd" | "bshd" | "thd"
    backend: Union[str, Callable] = "sdpa"  # "sdpa" | "flash" | "te" | a callable kernel
    softmax_scale: Optional[float] = None
    dropout_p: float = 0.0
    token_order: str = "contiguous"  # "contiguous" | "load_balanced" | "per_document"
    overlap_chunks: int = 1
    window_size: Optional[Tuple[int, int]] = None  # (left, right), -1 unbounded
    return_lse: bool = False

    @property
    def window(self) -> Optional[Tuple[int, int]]:
        """The window in force, or ``None`` (``(-1, -1)`` is none)."""
        return tuple(self.window_size) if has_window(self.window_size) else None


_CACHE: dict = {}
_CACHE_MAX = 1024


def attention_options(
    causal,
    layout="sbhd",
    backend="sdpa",
    softmax_scale=None,
    dropout_p=0.0,
    token_order="contiguous",
    overlap_chunks=1,
    window_size=None,
    return_lse=False,
):
    """The :class:`AttentionOptions` of these values: one dict lookup when seen before."""
    if isinstance(window_size, list):
        window_size = tuple(window_size)
    key = (causal, layout, backend, softmax_scale, dropout_p, token_order, overlap_chunks, window_size, return_lse)
    try:  # the types too: causal=1 or dropout_p=False must reach the validator as given, not as True / 0.0
        rec = _CACHE.get(key + (type(causal), type(dropout_p), type(return_lse)))
    except TypeError:  # an unhashable value: the validator will name it
        return AttentionOptions(*key)
    if rec is None:
        rec = AttentionOptions(*key)
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key + (type(causal), type(dropout_p), type(return_lse))] = rec
    return rec


__all__ = ["AttentionOptions", "attention_options", "has_window", "options_set", "LSE_TILE", "VARIANT_OPTIONS"]
