"""Input validation that ends the same way on every rank, once per call signature: each rank writes
its inputs and any problem it sees into a :class:`CallRecord`, the group exchanges the records
(one ``all_gather_object``), and every rank runs the same pure :func:`verdict` -- the same
``ValueError`` everywhere, or none (docs/design.md, "Validation off the hot path").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..exchange.heads import seq_dim
from ..exchange.orders import TOKEN_ORDERS
from ..exchange.transport import is_fake_group
from ..options import NO_TENSORS, OPTIONS, PER_CALL, CallSite, CallTensors, has_window
from .checks import CallView, int_list, local_problem


def _sig(t) -> Optional[tuple]:
    """A per-call tensor as the ranks compare it: ``(shape, dtype, requires_grad)``, None if absent."""
    if t is None or not isinstance(t, torch.Tensor):
        return None if t is None else ((), type(t).__name__, False)
    return tuple(t.shape), str(t.dtype).replace("torch.", ""), t.requires_grad


def _shape(t) -> Tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


# the per-call data the ranks compare: (field of CallTensors, how it is recorded, what a disagreement is called)
_DATA = tuple((name, f.compared, f.called) for name, f in PER_CALL.items() if f.compared)


@dataclass(frozen=True)
class CallRecord:
    """One rank's view of one call, compared across ranks: its own problem ("" = none: it travels to
    every rank), the site's options by name as compared (:data:`~ulysses_mcore.options.OPTIONS`; the
    backend by name, the window in force), the query's and key's shapes, their dtype and device
    type (one each, or the local checks' problem), the degrees and the per-call data of
    :data:`_DATA` by name (a tensor as ``(shape, dtype, requires_grad)``)."""

    problem: str
    options: Dict[str, Any]
    query: Tuple[int, ...]
    key: Tuple[int, ...]
    dtype: str = ""
    device: str = ""
    ulysses: int = 1
    ring: int = 1
    data: Dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- one rank
def _backend_name(backend) -> str:
    return backend if isinstance(backend, str) else "callable"


def _ring_problem(r: CallRecord) -> str:
    o, bias = r.options, r.data["attention_bias"]  # bias: (shape, dtype, requires_grad) or None
    if r.ring <= 1:
        return ""
    if o["backend"] not in ("sdpa", "te"):
        return (
            f"a ring (ring_group of {r.ring} ranks, --context-parallel-size) runs with backend='sdpa' (the "
            f"log-sum-exp ring) or 'te' (Transformer Engine's p2p ring); got backend={o['backend']!r}"
        )
    if o["dropout_p"]:
        return (
            f"attention dropout is not supported with a ring (ring_group of {r.ring} ranks): set --attention-dropout 0"
        )
    if bias is not None and bias[2]:
        return (
            "attention_bias requires grad, but the ring treats the bias as a constant: pass "
            "attention_bias.detach() or use --context-parallel-size 1"
        )
    if r.data["seqlens"] is not None:
        return (
            "packed documents with padding between them (cu_seqlens_q != cu_seqlens_q_padded) cannot run with "
            "a ring: build the batch with ulysses_mcore.megatron.layer.batch.pack_batch + shard_batch"
        )
    if o["backend"] == "te" and (o["layout"] == "thd" or r.data["attention_mask"] is not None or bias is not None):
        return (
            "backend='te' with a ring takes causal / no-mask unpacked input only: use backend='sdpa' for "
            "masks, bias or packed sequences with a ring"
        )
    return ""


def _recorded(kind: str, t, problem: str):
    if kind == "sig":
        return _sig(t)
    return None if problem else int_list(t)


def call_record(qkv, site: CallSite, tensors: CallTensors = NO_TENSORS, sizes=(1, 1)) -> CallRecord:
    """This rank's record of a call (``sizes``: Ulysses degree, ring size).  Never raises: a
    problem is written into the record."""
    call = CallView(qkv, site, tensors, sizes)
    try:
        problem = local_problem(call)
    except Exception as ex:  # noqa: BLE001 - whatever it is, every rank must hear of it
        problem = f"invalid input ({type(ex).__name__}: {ex})"
    compared = {name: getattr(site, name) for name in OPTIONS} | {
        "layout": str(site.layout),
        "backend": _backend_name(site.backend),
        "token_order": str(site.token_order),
        "window_size": tuple(site.window_size) if has_window(site.window_size) and not problem else None,
    }
    q = qkv[0]
    rec = CallRecord(
        problem,
        compared,
        query=_shape(q),
        key=_shape(qkv[1]),
        dtype=str(getattr(q, "dtype", "")).replace("torch.", ""),
        device=getattr(getattr(q, "device", None), "type", ""),
        ulysses=sizes[0],
        ring=sizes[1],
        data={name: _recorded(kind, getattr(tensors, name), problem) for name, kind, _ in _DATA},
    )
    if not problem:
        problem = _ring_problem(rec) or _full_sequence_problem(rec)
        if problem:
            rec = replace(rec, problem=problem)
    return rec


def _full_sequence_problem(r: CallRecord) -> str:
    layout = r.options["layout"]
    sdim = seq_dim(layout)
    seq = r.query[sdim] * r.ulysses * r.ring
    b = 1 if layout == "thd" else r.query[1 - sdim]
    heads = r.query[-2]
    if r.options["token_order"] == "load_balanced" and r.query[sdim] % 2:
        return (
            f"token_order='load_balanced' holds 2 chunks per rank, so the tokens per rank must be even; there "
            f"are {r.query[sdim]}: make the sequence a multiple of {2 * r.ulysses * r.ring}"
        )
    for name in ("attention_mask", "attention_bias"):
        s = r.data[name]
        if s is None:
            continue
        shp = list(s[0])
        if len(shp) != 4 or any(x not in (1, w) for x, w in zip(shp[:3], (b, heads, seq))) or shp[3] != seq:
            return (
                f"{name} must cover the full sequence, shape [b or 1, heads or 1, {seq} or 1, {seq}] (b={b}, "
                f"heads={heads}; 1 = broadcast, never expanded); it is {shp if len(shp) == 4 else 'not 4-D'}"
            )
    return ""


# ----------------------------------------------------------------------------- all ranks
def _tokens(r: CallRecord) -> int:
    return r.query[seq_dim(r.options["layout"])]


def _option(name: str):
    return lambda r: r.options[name]


def _datum(name: str):
    return lambda r: r.data[name]


_AGREE = (  # (what the message calls it, the value compared), in the order they are reported
    [
        ("layout", _option("layout")),
        (
            "tokens per rank (the sequence must be split evenly: pad it to a multiple of the degree with masked "
            "tokens)",
            _tokens,
        ),
        ("query shape", lambda r: list(r.query)),
        ("key/value shape", lambda r: list(r.key)),
        ("dtype", lambda r: r.dtype),
        ("device", lambda r: r.device),
    ]
    + [(name, _option(name)) for name in OPTIONS if name != "layout"]
    + [("Ulysses degree", lambda r: r.ulysses), ("ring size", lambda r: r.ring)]
    + [(what, _datum(name)) for name, _, what in _DATA]
)


def verdict(records: Sequence[CallRecord], ulysses: int) -> Optional[str]:
    """The first problem over every rank's record, or ``None``.  Pure: same answer everywhere.

    ``records``: one per rank of the sample group, Ulysses rank fastest (``u + degree*j``)."""
    ring = len(records) // max(ulysses, 1)
    for r, rec in enumerate(records):
        if rec.problem:
            where = f"rank {r % ulysses} of the Ulysses group" + (f", ring rank {r // ulysses}" if ring > 1 else "")
            return f"{rec.problem} (on {where})"
    for what, get in _AGREE:
        vals = [get(rec) for rec in records]
        if any(v != vals[0] for v in vals):
            vals = [list(v) if isinstance(v, tuple) else v for v in vals]
            who = "Ulysses group" if ring <= 1 else f"Ulysses x ring group ({ulysses} x {ring})"
            return f"ranks of the {who} disagree in {what}: per rank {vals}"
    return None


def exchange(rec: CallRecord, group) -> List[CallRecord]:
    """Every rank's record (one all_gather_object: a first call of a signature only).  In a fake
    world (torch's ``"fake"`` backend: the dry run's cluster in one process) every rank is this
    rank, so its own record stands for all of them."""
    if is_fake_group(group):
        return [rec] * dist.get_world_size(group)
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, rec, group=group)
    return out


def group_sizes(site: CallSite) -> Tuple[int, int]:
    """(Ulysses degree, ring size) of a site's groups (1 for ``None``; -1 where this rank is not a member)."""
    ulysses = 1 if site.group is None else dist.get_world_size(site.group)
    return ulysses, 1 if site.ring_group is None else dist.get_world_size(site.ring_group)


def check_call(qkv, site: CallSite, tensors: CallTensors = NO_TENSORS) -> None:
    """Raise the same ``ValueError`` on every rank of the Ulysses (x ring) group, or none: this
    rank's record, every rank's records (one ``all_gather_object``, two with a ring), one verdict."""
    ulysses, ring = group_sizes(site)
    records = [call_record(qkv, site, tensors, (ulysses, ring))]
    if ulysses > 1:
        records = exchange(records[0], site.group)
    if ring > 1:  # every rank of the sample group sees every record: one verdict everywhere
        records = [r for block in exchange(records, site.ring_group) for r in block]
    problem = verdict(records, ulysses)
    if problem:
        raise ValueError(f"ulysses_attention: {problem}")


__all__ = ["CallRecord", "call_record", "check_call", "verdict", "TOKEN_ORDERS"]
