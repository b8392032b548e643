"""Validation: ranks that disagree, or hold what only they can see is wrong, all end in the
same ValueError -- or exact results -- never a hang or a silent wrong answer.  Threaded worlds
(real collectives between threads); each case names the rank(s) that differ."""

import pytest
import torch
import torch.distributed as dist

import ulysses_mcore
from ulysses_mcore.validation import record as validation
from tests.helpers import run_threaded, run_threaded_errors

S, B, H, D = 16, 2, 4, 8


def inputs(rank, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(S, B, H, D, generator=g) for _ in range(3)]
    return [t.chunk(P)[rank].clone() for t in full]


def call(rank, P, **kw):
    q, k, v = kw.pop("qkv", None) or inputs(rank, P)
    kw.setdefault("causal", True)
    return ulysses_mcore.ulysses_attention(q, k, v, group=dist.group.WORLD, **kw)


def packed(rank, P, cu, **kw):
    t = torch.randn(16 // P, H, D)
    return ulysses_mcore.ulysses_attention(
        t, t, t, group=dist.group.WORLD, causal=True, layout="thd", cu_seqlens=cu, **kw
    )


def on_rank(r, bad, good=None):
    """A per-rank value: ``bad`` on rank ``r``, ``good`` elsewhere."""
    return lambda rank: bad if rank == r else good


CASES = {
    # name: (per-rank call, substrings of the one message)
    "thd with a 4-D tensor on one rank": (
        lambda rank, P: call(rank, P, layout=on_rank(1, "thd", "sbhd")(rank)),
        ["3-D", "rank 1"],
    ),
    "list mask on one rank": (
        lambda rank, P: call(rank, P, attention_mask=on_rank(0, [[True]])(rank)),
        ["attention_mask", "list"],
    ),
    "list cu_seqlens on one rank": (
        lambda rank, P: packed(rank, P, on_rank(1, [0, 16], torch.tensor([0, 16]))(rank)),
        ["cu_seqlens", "rank 1"],
    ),
    "causal None vs False": (
        lambda rank, P: call(rank, P, causal=on_rank(0, None, False)(rank)),
        ["causal must be True or False", "None"],
    ),
    "softmax_scale differs": (
        lambda rank, P: call(rank, P, softmax_scale=on_rank(1, 0.5, 0.25)(rank)),
        ["disagree in softmax_scale"],
    ),
    "dropout_p differs": (
        lambda rank, P: call(rank, P, dropout_p=on_rank(1, 0.1, 0.0)(rank)),
        ["disagree in dropout_p"],
    ),
    "bias on one rank only": (
        lambda rank, P: call(rank, P, attention_bias=on_rank(0, torch.zeros(1, 1, S, S))(rank)),
        ["disagree in attention_bias"],
    ),
    "float mask": (
        lambda rank, P: call(rank, P, attention_mask=torch.zeros(1, 1, S, S)),
        ["must be a bool tensor", "float32"],
    ),
    "int mask (1 = keep)": (
        lambda rank, P: call(rank, P, attention_mask=torch.ones(1, 1, S, S, dtype=torch.int64)),
        ["must be a bool tensor", "~mask.bool()"],
    ),
    "int inputs": (lambda rank, P: call(rank, P, qkv=[t.long() for t in inputs(rank, P)]), ["floating-point", "int64"]),
    "complex inputs": (
        lambda rank, P: call(rank, P, qkv=[t.to(torch.complex64) for t in inputs(rank, P)]),
        ["floating-point", "complex64"],
    ),
    "cu_seqlens differ (a checksum collision once)": (
        lambda rank, P: packed(rank, P, torch.tensor([0, 1, 2, 3, 13, 16] if rank == 0 else [0, 1, 2, 8, 9, 16])),
        ["disagree in cu_seqlens", "[0, 1, 2, 3, 13, 16]"],
    ),
    "overlap_chunks not an int": (
        lambda rank, P: call(rank, P, overlap_chunks=1.5),
        ["overlap_chunks must be an integer"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_error_on_every_rank(name):
    fn, needles = CASES[name]
    errors = run_threaded_errors(2, fn)
    assert all(isinstance(e, ValueError) for e in errors), errors
    messages = {str(e) for e in errors}
    assert len(messages) == 1, messages
    for needle in needles:
        assert needle in messages.copy().pop(), (needle, messages)


def test_group_without_this_rank():
    """A rank handed a group it is not in gets a ValueError at once (no peer waits on it there);
    the group's own ranks run normally."""

    def fn(rank, world):
        sub = dist.new_group([0, 1])
        q, k, v = inputs(rank % 2, 2)
        try:
            out = ulysses_mcore.ulysses_attention(q, k, v, group=sub, causal=True)
        except ValueError as e:
            return str(e)
        return out.shape

    res = run_threaded(4, fn)
    assert res[0] == res[1] == (S // 2, B, H, D)
    assert all("not a member" in r for r in res[2:]), res


def test_double_backward_is_refused():
    def fn(rank, world):
        q, k, v = (t.requires_grad_() for t in inputs(rank, world))
        out = ulysses_mcore.ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True)
        (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice|once_differentiable"):
            gq.sum().backward()
        return True

    assert all(run_threaded(2, fn))


def test_verdict_is_cached_per_signature():
    """A second call with the same signature exchanges nothing; a new shape is checked again (a new
    world's group is a new signature: nothing cached from another test)."""
    from tests.helpers import count_collectives

    def fn(rank, world):
        seen = []
        for s in (S, S, 2 * S, S):
            q = torch.randn(s // world, B, H, D)
            before = c.get("all_gather_object")
            ulysses_mcore.ulysses_attention(q, q, q, group=dist.group.WORLD, causal=True)
            seen.append(c.get("all_gather_object") - before)
        return seen

    with count_collectives() as c:
        res = run_threaded(2, fn)
    assert res == [[1, 0, 1, 0]] * 2


def test_record_fields_are_compared_exactly():
    from ulysses_mcore.options import CallTensors, call_site

    site = call_site(True, layout="thd")
    t = torch.randn(8, H, D)
    a = validation.call_record((t, t, t), site, CallTensors(cu_seqlens=torch.tensor([0, 1, 2, 3, 13, 16])), (2, 1))
    b = validation.call_record((t, t, t), site, CallTensors(cu_seqlens=torch.tensor([0, 1, 2, 8, 9, 16])), (2, 1))
    assert a.problem == b.problem == ""
    assert "disagree in cu_seqlens" in validation.verdict([a, b], 2)
    assert validation.verdict([a, a], 2) is None
