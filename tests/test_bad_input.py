"""Bad input: a ValueError naming the argument, the values and the fix, on EVERY rank.

Each case runs in a threaded world where only some ranks may hold the bad input; every
rank must return (no hang) with the same message.
"""

import time

import pytest
import torch
import torch.distributed as dist

import ulysses_mcore
from ulysses_mcore.validation import record as validation
from tests.helpers import count_collectives, run_threaded_errors

S, B, D = 16, 2, 8


def t(s=S // 4, b=B, h=4, d=D, dtype=torch.float32, device="cpu", layout="sbhd"):
    shape = (s, b, h, d) if layout == "sbhd" else (b, s, h, d)
    return torch.randn(shape, dtype=dtype, device=device)


def good(rank, P, hq=4, hk=4):
    s = S // P
    return dict(query=t(s, h=hq), key=t(s, h=hk), value=t(s, h=hk))


def bad_shard_len(rank, P):
    s = S // P + (1 if rank == 1 else 0)
    return dict(query=t(s), key=t(s), value=t(s))


def bad_heads(rank, P):  # fewer query heads than ranks (uneven heads need >= 1 per rank)
    return dict(query=t(S // P, h=3), key=t(S // P, h=3), value=t(S // P, h=3))


def bad_kv(rank, P):  # 12 query heads cannot be grouped over 5 kv heads
    return dict(query=t(S // P, h=12), key=t(S // P, h=5), value=t(S // P, h=5))


def bad_dtype_rank0(rank, P):
    kw = good(rank, P)
    if rank == 0:
        kw["key"] = kw["key"].double()
    return kw


def bad_device_rank1(rank, P):
    kw = good(rank, P)
    if rank == 1:
        kw["value"] = torch.empty(kw["value"].shape, device="meta")
    return kw


def bad_batch(rank, P):
    kw = good(rank, P)
    kw["key"] = t(S // P, b=B + 1)
    kw["value"] = t(S // P, b=B + 1)
    return kw


def bad_head_dim(rank, P):  # the value's may differ (multi-latent attention); the key's may not
    kw = good(rank, P)
    kw["key"] = t(S // P, d=D + 1)
    return kw


def bad_ndim(rank, P):
    kw = good(rank, P)
    kw["query"] = kw["query"].flatten(2)
    return kw


def bad_empty(rank, P):
    return dict(query=t(0), key=t(0), value=t(0))


def bad_mask(rank, P):
    kw = good(rank, P)
    kw["attention_mask"] = torch.zeros(B, 1, S // P, S, dtype=torch.bool)  # a shard, not the full seq
    return kw


CASES = {
    # name: (make inputs, extra kwargs per rank, substrings every message must contain)
    "shard lengths differ": (bad_shard_len, {}, ["tokens per rank", "[4, 5, 4, 4]", "pad"]),
    "fewer heads than ranks": (bad_heads, {}, ["ulysses degree 4", "larger than the 3 query heads", "degree <= 3"]),
    "kv heads incompatible": (bad_kv, {}, ["query heads (12) must be a multiple of kv heads (5)"]),
    "dtype differs on rank 0": (bad_dtype_rank0, {}, ["one dtype", "rank 0", "float64", "cast"]),
    "device differs on rank 1": (bad_device_rank1, {}, ["one device", "rank 1", "meta"]),
    "batch differs": (bad_batch, {}, ["batch size", "2, 3, 3"]),
    "key head dim differs": (bad_head_dim, {}, ["query and key disagree in head dim", "8, 9"]),
    "3-D query": (bad_ndim, {}, ["query must be a 4-D", "3-D"]),
    "empty shard": (bad_empty, {}, ["empty", "length 0"]),
    "mask not full sequence": (bad_mask, {}, ["attention_mask", "full sequence", "[2, 1, 4, 16]"]),
    "unknown layout": (good, {"layout": "bhsd"}, ["layout='bhsd'", "'sbhd'"]),
    "unknown backend": (good, {"backend": "xformers"}, ["backend='xformers'", "unknown", "sdpa"]),
    "backend not installed": (good, {"backend": "flash"}, ["flash-attn", "ulysses-mcore[flash]", "backend='sdpa'"]),
    "causal differs": (good, "causal_by_rank", ["disagree in causal"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_clear_error(name):
    make, extra, needles = CASES[name]
    P = 4

    def rank_fn(rank, world):
        kw = make(rank, world)
        opts = {"causal": True}
        if extra == "causal_by_rank":
            opts["causal"] = rank != 2
        else:
            opts.update(extra)
        ulysses_mcore.ulysses_attention(**kw, group=dist.group.WORLD, **opts)

    t0 = time.time()
    errors = run_threaded_errors(P, rank_fn)
    assert time.time() - t0 < 30  # every rank ends, none waits on a collective
    assert all(isinstance(e, ValueError) for e in errors), errors
    messages = {str(e) for e in errors}
    assert len(messages) == 1, messages
    msg = messages.pop()
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_no_data_collective_before_the_error():
    """The error is raised after the metadata gather only: no all-to-all was issued."""
    with count_collectives() as c:
        errors = run_threaded_errors(
            4, lambda r, w: ulysses_mcore.ulysses_attention(**bad_heads(r, w), group=dist.group.WORLD, causal=True)
        )
    assert all(isinstance(e, ValueError) for e in errors)
    assert c.total("all_to_all_single") == 0 and c.total("all_gather_object") == 4


def test_find_problem_is_pure_and_accepts_good_input():
    from ulysses_mcore.options import call_site

    site = call_site(True)

    def record(kw):
        return validation.call_record((kw["query"], kw["key"], kw["value"]), site, sizes=(2, 1))

    recs = [record(good(r, 2)) for r in range(2)]
    assert validation.verdict(recs, 2) is None
    recs[1] = record(bad_shard_len(1, 2))
    assert "tokens per rank" in validation.verdict(recs, 2)


def test_single_rank_errors_too():
    with pytest.raises(ValueError, match="one dtype"):
        kw = good(0, 1)
        kw["key"] = kw["key"].half()
        ulysses_mcore.ulysses_attention(**kw, group=None, causal=True)
