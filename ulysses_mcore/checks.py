"""Input validation that gives the same error on every rank of a Ulysses group.

A rank that raises before a collective its peers have entered leaves them hanging.  So
every rank first describes its inputs as a short vector of integers (:func:`describe`),
the group all-gathers those vectors (one tiny collective), and every rank runs the same
pure function (:func:`find_problem`) over all of them.  Whatever is wrong on any rank is
reported, with the same message, everywhere, before the data all-to-all is issued.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .backends import BUILTIN_BACKENDS, backend_error
from .comm import LAYOUTS, head_layout_error, is_even

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8,
]
_DEVICES = ["cpu", "cuda", "meta"]
_NAME = 8  # characters of the layout / backend name carried in the vector
COLLECTIVE_CALLS = {"all_gather": 0}


def _code(x, table) -> int:
    return table.index(x) if x in table else len(table)


def _encode_name(name: str) -> List[int]:
    raw = name.encode()[:_NAME]
    return list(raw) + [0] * (_NAME - len(raw))


def _decode_name(vals: Sequence[int]) -> str:
    return bytes(v for v in vals if v).decode(errors="replace")


def _shape4(t: Optional[torch.Tensor]) -> List[int]:
    if t is None:
        return [-2] * 4
    if t.dim() != 4:
        return [-1] * 4
    return list(t.shape)


TOKEN_ORDERS = ("contiguous", "load_balanced", "per_document")


def _describe_cu(cu) -> List[int]:
    """present, documents, total, first, nondecreasing, 1-D integer, checksum, gcd of lengths."""
    if cu is None:
        return [0] * 8
    ok_kind = int(cu.dim() == 1 and not cu.is_floating_point() and cu.numel() >= 2)
    if not ok_kind:
        return [1, 0, 0, 0, 0, 0, 0, 0]
    c = cu.detach().to("cpu", torch.int64)
    mono = int(bool((c[1:] >= c[:-1]).all()))
    weights = torch.arange(1, c.numel() + 1, dtype=torch.int64)
    gcd = 0
    for n in (c[1:] - c[:-1]).tolist():
        gcd = math.gcd(gcd, n)
    return [1, c.numel() - 1, int(c[-1]), int(c[0]), mono, 1, int((c * weights).sum() % (1 << 40)), gcd]


def describe(query, key, value, *, layout, backend, causal, attention_mask=None, attention_bias=None,
             token_order="contiguous", overlap_chunks=1, ring=1, dropout=False, bias_grad=False,
             cu_seqlens=None, thd=False):
    """This rank's inputs as integers (see module docstring)."""
    vec: List[int] = []
    for t in (query, key, value):
        vec += [t.dim()] + _shape4(t)
        vec += [_code(t.dtype, _DTYPES), _code(t.device.type, _DEVICES)]
    vec += _shape4(attention_mask) + _shape4(attention_bias)
    vec.append(_code(layout, list(LAYOUTS)))
    vec += _encode_name(layout if isinstance(layout, str) else repr(layout))
    err = backend_error(backend)
    if err is None:
        kind = 0
    elif isinstance(backend, str) and backend in BUILTIN_BACKENDS:
        kind = 2  # known, not installed
    else:
        kind = 1  # unknown
    vec.append(kind)
    vec += _encode_name(backend if isinstance(backend, str) else "callable")
    vec.append(int(bool(causal)))
    vec.append(_code(token_order, list(TOKEN_ORDERS)))
    vec.append(int(overlap_chunks))
    vec += [int(ring), int(bool(dropout)), int(bool(bias_grad)), int(bool(thd))]
    vec += _describe_cu(cu_seqlens)
    return vec


VECTOR_LEN = len(describe(torch.empty(1, 1, 1, 1), torch.empty(1, 1, 1, 1), torch.empty(1, 1, 1, 1),
                          layout="sbhd", backend="sdpa", causal=True))


def split(flat: Sequence[int], n: int) -> List[List[int]]:
    """``n`` concatenated vectors -> the list of vectors."""
    flat = list(flat)
    size = len(flat) // n
    return [flat[i * size:(i + 1) * size] for i in range(n)]


def gather(vec: List[int], group) -> List[List[int]]:
    """All ranks' vectors (one all_gather of a few dozen int64)."""
    size = dist.get_world_size(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor(vec, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(size)]
    COLLECTIVE_CALLS["all_gather"] += 1
    dist.all_gather(out, mine, group=group)
    return [o.tolist() for o in out]


def _unpack(vec):
    it = iter(vec)
    d = {}
    for n in ("query", "key", "value"):
        d[n] = {
            "ndim": next(it),
            "shape": [next(it) for _ in range(4)],
            "dtype": next(it),
            "device": next(it),
        }
    d["mask"] = [next(it) for _ in range(4)]
    d["bias"] = [next(it) for _ in range(4)]
    d["layout_code"] = next(it)
    d["layout"] = _decode_name([next(it) for _ in range(_NAME)])
    d["backend_kind"] = next(it)
    d["backend"] = _decode_name([next(it) for _ in range(_NAME)])
    d["causal"] = next(it)
    d["token_order"] = next(it)
    d["overlap_chunks"] = next(it)
    for n in ("ring", "dropout", "bias_grad", "thd"):
        d[n] = next(it)
    d["cu"] = [next(it) for _ in range(8)]
    return d


def _dt(code):
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "other"


def _dev(code):
    return _DEVICES[code] if code < len(_DEVICES) else "other"


def _ring_or_packed_problem(d, where: str) -> Optional[str]:
    """What a ring (``ring_group`` of size > 1) or a packed ``thd`` input cannot take."""
    ring, backend = d["ring"], d["backend"]
    if ring > 1:
        if backend not in ("sdpa", "te"):
            return (f"a ring (ring_group of {ring} ranks, --context-parallel-size) runs with backend='sdpa' (the "
                    f"log-sum-exp ring) or 'te' (Transformer Engine's p2p ring); {where} backend={backend!r}")
        if d["dropout"]:
            return (f"attention dropout is not supported with a ring (ring_group of {ring} ranks) {where}: "
                    "set --attention-dropout 0")
        if d["bias_grad"]:
            return (f"attention_bias requires grad {where}, but the ring treats the bias as a constant: "
                    "pass attention_bias.detach() or use --context-parallel-size 1")
        if backend == "te" and (d["thd"] or d["mask"][0] != -2 or d["bias"][0] != -2):
            return (f"backend='te' with a ring takes causal / no-mask unpacked input only {where}: use "
                    "backend='sdpa' for masks, bias or packed sequences with a ring")
    cu = d["cu"]
    if d["thd"]:
        if not cu[0]:
            return f"layout='thd' needs cu_seqlens (the global document boundaries of the packed stream) {where}"
        if d["mask"][0] != -2 or d["bias"][0] != -2:
            return (f"layout='thd' takes no attention_mask / attention_bias {where}: documents are "
                    "separated by cu_seqlens; unpack to 'sbhd' for arbitrary masks")
        if backend == "callable":
            return f"layout='thd' needs backend='sdpa', 'flash' or 'te' (varlen kernels) {where}, not a callable"
    elif cu[0]:
        return f"cu_seqlens is given {where} but layout={d['layout']!r}: pass layout='thd' for packed sequences"
    if cu[0]:
        if not cu[5]:
            return f"cu_seqlens must be a 1-D integer tensor [documents + 1] {where}"
        if cu[3] != 0 or not cu[4]:
            return (f"cu_seqlens must start at 0 and never decrease {where} (it starts at {cu[3]}): "
                    "give the cumulative document lengths of the whole packed stream")
    return None


def _rank_problem(d, rank: int, degree: int) -> Optional[str]:
    where = f"on rank {rank} of the Ulysses group"
    if d["layout_code"] >= len(LAYOUTS):
        return f"layout={d['layout']!r} {where} is unknown: use 'sbhd' ([s, b, h, d], Megatron's) or 'bshd'"
    if d["backend_kind"] == 1:
        return (f"backend={d['backend']!r} {where} is unknown: use one of "
                f"{list(BUILTIN_BACKENDS)} or a callable (q, k, v, *, causal, softmax_scale) -> out")
    if d["backend_kind"] == 2:
        return backend_error(d["backend"]) + f" ({where})"
    layout = d["layout"]
    q, k, v = d["query"], d["key"], d["value"]
    for n in ("query", "key", "value"):
        if d[n]["ndim"] != 4:
            return f"{n} must be a 4-D [{','.join(layout)}] tensor; {where} it is {d[n]['ndim']}-D"
    if len({q["dtype"], k["dtype"], v["dtype"]}) > 1:
        return (f"query, key and value must share one dtype; {where} they are "
                f"{_dt(q['dtype'])}, {_dt(k['dtype'])}, {_dt(v['dtype'])}: cast them to one dtype")
    if len({q["device"], k["device"], v["device"]}) > 1:
        return (f"query, key and value must be on one device; {where} they are on "
                f"{_dev(q['device'])}, {_dev(k['device'])}, {_dev(v['device'])}: move them to one device")
    sdim = 0 if layout == "sbhd" else 1
    bdim = 1 - sdim
    names = {sdim: "sequence", bdim: "batch", 3: "head"}
    for dim in (sdim, bdim, 3):
        vals = (q["shape"][dim], k["shape"][dim], v["shape"][dim])
        if len(set(vals)) > 1:
            return (f"query, key and value disagree in {names[dim]} {'dim' if dim == 3 else 'size'} "
                    f"(dim {dim} of [{','.join(layout)}]) {where}: {vals[0]}, {vals[1]}, {vals[2]}")
    if k["shape"][2] != v["shape"][2]:
        return f"key and value must have the same number of heads; {where}: {k['shape'][2]} and {v['shape'][2]}"
    if q["shape"][sdim] < 1:
        return f"the sequence shard is empty {where} (length 0): every rank needs at least one token"
    if d["token_order"] >= len(TOKEN_ORDERS):
        return f"token_order {where} is unknown: use one of {list(TOKEN_ORDERS)}"
    if d["token_order"] == 2:
        need = 2 * degree * d["ring"]
        if not d["thd"]:
            return f"token_order='per_document' is for packed input (layout='thd' with cu_seqlens) {where}"
        if d["ring"] > 1:
            return (f"token_order='per_document' (Transformer Engine's THD layout) does not combine with a ring "
                    f"{where}: shard the packed stream with token_order='load_balanced' instead")
        if d["cu"][0] and d["cu"][7] % need:
            return (f"token_order='per_document' deals every document out in {need} chunks, so every (padded) "
                    f"document length must be a multiple of {need} {where}: pad the documents "
                    f"(cu_seqlens_padded), or shard the stream whole with token_order='load_balanced'")
    if d["token_order"] == 1 and q["shape"][sdim] % 2:
        return (f"token_order='load_balanced' holds 2 chunks per rank, so the tokens per rank must be "
                f"even; {where} there are {q['shape'][sdim]}: make the sequence a multiple of {2 * degree}")
    err = head_layout_error(q["shape"][2], k["shape"][2], degree)
    if err:
        return f"{err} ({where}; heads are dim 2 of [{','.join(layout)}])"
    if degree > 1:
        from .comm import HeadPlan
        from .overlap import overlap_error

        if is_even(q["shape"][2], k["shape"][2], degree):
            err = overlap_error(HeadPlan(q["shape"][2], k["shape"][2], degree), d["overlap_chunks"])
        elif d["overlap_chunks"] != 1:
            err = f"overlap_chunks={d['overlap_chunks']} needs heads that divide evenly over the degree {degree}"
        if err:
            return f"{err} ({where})"
    err = _ring_or_packed_problem(d, where)
    if err:
        return err
    seq = q["shape"][sdim] * degree * d["ring"]
    if d["cu"][0] and d["cu"][2] != seq:
        return (f"cu_seqlens ends at {d['cu'][2]} {where}, but the packed stream is {seq} tokens "
                f"({q['shape'][sdim]} per rank x {degree * d['ring']} ranks): cu_seqlens must cover the "
                "whole global stream; pad the stream to a multiple of the degree with a last document")
    for n in ("mask", "bias"):
        shp = d[n]
        if shp[0] == -2:
            continue
        arg = "attention_mask" if n == "mask" else "attention_bias"
        want = [q["shape"][bdim], q["shape"][2], seq, seq]
        if shp[0] == -1 or any(s not in (1, w) for s, w in zip(shp[:2], want[:2])) or shp[2:] != want[2:]:
            return (f"{arg} must cover the full sequence, shape [b or 1, heads or 1, {seq}, {seq}] "
                    f"(b={want[0]}, heads={want[1]}); {where} it is {shp if shp[0] != -1 else 'not 4-D'}")
    return None


def find_problem(vectors: Sequence[Sequence[int]], degree: Optional[int] = None,
                 ring: int = 1) -> Optional[str]:
    """The first problem over every rank's inputs, or ``None``.  Pure: same answer everywhere.

    ``vectors``: one per rank of the sample group, Ulysses rank fastest (``u + degree*j``)."""
    degree = len(vectors) if degree is None else degree
    ds = [_unpack(v) for v in vectors]
    for r, d in enumerate(ds):
        err = _rank_problem(d, r % degree, degree)
        if err:
            if len(ds) > degree:
                err = err.replace("of the Ulysses group", f"of the Ulysses group, ring rank {r // degree}")
            return err
    if len(ds) == 1:
        return None
    layout = ds[0]["layout"]
    sdim = 0 if layout == "sbhd" else 1
    checks = [
        ("layout", lambda d: d["layout"]),
        ("tokens per rank (the sequence must be split evenly: pad it to a multiple of "
         f"the Ulysses degree {degree} with masked tokens)", lambda d: d["query"]["shape"][sdim]),
        ("batch size", lambda d: d["query"]["shape"][1 - sdim]),
        ("query heads", lambda d: d["query"]["shape"][2]),
        ("kv heads", lambda d: d["key"]["shape"][2]),
        ("head dim", lambda d: d["query"]["shape"][3]),
        ("dtype", lambda d: _dt(d["query"]["dtype"])),
        ("causal", lambda d: bool(d["causal"])),
        ("token_order", lambda d: TOKEN_ORDERS[d["token_order"]]),
        ("overlap_chunks", lambda d: d["overlap_chunks"]),
        ("attention_mask shape", lambda d: d["mask"]),
        ("backend", lambda d: d["backend"]),
        ("ring size", lambda d: d["ring"]),
        ("cu_seqlens (the global document boundaries must be identical on every rank)", lambda d: d["cu"]),
    ]
    for what, get in checks:
        vals = [get(d) for d in ds]
        if any(v != vals[0] for v in vals):
            who = "Ulysses group" if len(ds) == degree else f"Ulysses x ring group ({degree} x {ring})"
            return f"ranks of the {who} disagree in {what}: per rank {vals}"
    return None
