"""ulysses_attention forward and backward against float64 full-sequence attention.

Tier 2: threaded process groups (real collectives between threads), P = 2, 4, 8.
"""

import os

import pytest
import torch
import torch.distributed as dist

import ulysses_mcore
from ulysses_mcore.exchange import heads
from tests.helpers import count_collectives, reference_attention, run_threaded

FP32_RTOL = 1e-5  # max |err| / max |ref|
BF16_RTOL = 2e-2


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def make_inputs(seed, S, b, hq, hk, d, layout, dtype=torch.float32, mask=False, bias=False):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (S, b, h, d)) if layout == "sbhd" else (lambda h: (b, S, h, d))
    q = torch.randn(shape(hq), generator=g).to(dtype)
    k = torch.randn(shape(hk), generator=g).to(dtype)
    v = torch.randn(shape(hk), generator=g).to(dtype)
    dout = torch.randn(shape(hq), generator=g).to(dtype)
    m = bi = None
    if mask:  # padding-style: last tokens of batch 1 are masked as keys, plus random holes
        m = torch.rand(b, 1, S, S, generator=g) < 0.2
        m[-1, :, :, S - 3 :] = True
    if bias:
        bi = torch.randn(1, hq, S, S, generator=g).to(dtype)
    return q, k, v, dout, m, bi


def run_case(
    P,
    S,
    b,
    hq,
    hk,
    d,
    layout,
    causal,
    dtype=torch.float32,
    mask=False,
    bias=False,
    backend="sdpa",
    scale=None,
    chunks=1,
):
    q, k, v, dout, m, bi = make_inputs(P * 1000 + hq * 10 + hk, S, b, hq, hk, d, layout, dtype, mask, bias)
    sd = 0 if layout == "sbhd" else 1

    def rank_fn(rank, world):
        group = dist.group.WORLD
        qs, ks, vs = (t.chunk(world, dim=sd)[rank].clone().requires_grad_() for t in (q, k, v))
        out = ulysses_mcore.ulysses_attention(
            qs,
            ks,
            vs,
            group=group,
            causal=causal,
            layout=layout,
            backend=backend,
            softmax_scale=scale,
            attention_mask=m,
            attention_bias=bi,
            overlap_chunks=chunks,
        )
        out.backward(dout.chunk(world, dim=sd)[rank])
        return out.detach(), qs.grad, ks.grad, vs.grad

    res = run_threaded(P, rank_fn)
    got = [torch.cat([r[i] for r in res], dim=sd) for i in range(4)]

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(
        qr, kr, vr, causal=causal, layout=layout, softmax_scale=scale, attention_mask=m, attention_bias=bi
    )
    ref.backward(dout.double())
    want = [ref.detach(), qr.grad, kr.grad, vr.grad]
    return [rel_err(a, b_) for a, b_ in zip(got, want)]


CASES = [
    # P, S, b, hq, hk, d, layout, causal
    (2, 16, 2, 4, 4, 8, "sbhd", True),
    (2, 16, 2, 4, 4, 8, "sbhd", False),
    (2, 16, 2, 4, 4, 8, "bshd", True),
    (2, 16, 1, 4, 2, 7, "bshd", False),
    (4, 32, 2, 8, 8, 16, "sbhd", True),
    (4, 32, 2, 8, 2, 16, "sbhd", True),  # GQA 8 q / 2 kv at P=4: kv replicated x2
    (4, 32, 2, 8, 2, 16, "bshd", False),
    (4, 32, 2, 8, 1, 8, "sbhd", True),  # MQA at P=4: kv replicated x4
    (4, 32, 3, 8, 1, 5, "bshd", True),  # MQA, odd head dim, odd batch
    (4, 32, 2, 8, 4, 8, "sbhd", False),  # kv scattered, 1 per rank
    (8, 32, 2, 8, 8, 8, "sbhd", True),
    (8, 32, 2, 16, 8, 8, "bshd", True),  # 2 q / 1 kv per rank
    (8, 64, 1, 8, 2, 24, "sbhd", False),  # kv replicated x4 at P=8
    (2, 16, 2, 6, 3, 13, "sbhd", True),  # odd head dim 13, odd kv heads scattered... 3 % 2 != 0
]


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if heads.is_even(c[3], c[4], c[0])],
    ids=lambda c: "P{}_s{}_b{}_q{}kv{}_d{}_{}_{}".format(*c[:7], "causal" if c[7] else "full"),
)
def test_fp32_matches_float64_reference(case):
    errs = run_case(*case)
    assert max(errs) < FP32_RTOL, f"rel errors out, dq, dk, dv = {errs}"


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_mask_and_bias(layout):
    errs = run_case(4, 32, 2, 8, 2, 8, layout, causal=True, mask=True, bias=True)
    assert max(errs) < FP32_RTOL, errs
    errs = run_case(2, 16, 2, 4, 4, 8, layout, causal=False, mask=True)
    assert max(errs) < FP32_RTOL, errs


def test_custom_scale_and_callable_backend():
    calls = []

    def kernel(q, k, v, *, causal, softmax_scale):
        calls.append(q.shape)
        return ulysses_mcore.kernels.sdpa.sdpa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)

    errs = run_case(4, 32, 2, 8, 2, 8, "sbhd", True, backend=kernel, scale=0.3)
    assert max(errs) < FP32_RTOL, errs
    # the kernel saw the gathered sequence and this rank's heads: [S, b, hq/P, d]
    assert calls and all(tuple(c) == (32, 2, 2, 8) for c in calls)


@pytest.mark.parametrize("P,hq,hk", [(2, 4, 4), (4, 8, 2), (4, 8, 1)])
def test_bf16(P, hq, hk):
    errs = run_case(P, 32, 2, hq, hk, 16, "sbhd", True, dtype=torch.bfloat16)
    assert max(errs) < BF16_RTOL, errs


def _calls(c):
    return {n: c.get(n) for n in ("all_to_all_single", "all_gather", "all_gather_object", "all_reduce")}


def test_collective_count_per_call():
    """First call of a signature: the records cross once (one all_gather_object) + 2 all-to-alls;
    steady state: exactly 2 all-to-alls forward and 2 backward, nothing else (a new world's group
    is a new signature: nothing cached from another test)."""
    q, k, v, dout, _, _ = make_inputs(0, 16, 1, 4, 2, 8, "sbhd")

    def rank_fn(rank, world):
        out = []
        for _ in range(3):
            qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
            before = _calls(c)
            o = ulysses_mcore.ulysses_attention(qs, ks, vs, group=dist.group.WORLD, causal=True)
            mid = _calls(c)
            o.backward(dout.chunk(world)[rank])
            after = _calls(c)
            out.append(({n: mid[n] - before[n] for n in mid}, {n: after[n] - mid[n] for n in mid}))
        return out

    with count_collectives() as c:
        results = run_threaded(2, rank_fn)
    for rank_calls in results:
        (f0, b0), (f1, b1), (f2, b2) = rank_calls
        assert f0["all_gather_object"] == 1 and f0["all_to_all_single"] == 2, f0
        for f, b in ((f1, b1), (f2, b2)):
            assert f == {"all_to_all_single": 2, "all_gather": 0, "all_gather_object": 0, "all_reduce": 0}, f
            assert b == {"all_to_all_single": 2, "all_gather": 0, "all_gather_object": 0, "all_reduce": 0}, b


def test_group_of_one_is_direct():
    q, k, v, dout, _, _ = make_inputs(1, 16, 2, 4, 2, 8, "sbhd")
    with count_collectives() as c:
        out = ulysses_mcore.ulysses_attention(q, k, v, group=None, causal=True)
    assert c.get("all_to_all_single") == 0
    ref = reference_attention(q, k, v, causal=True)
    assert rel_err(out, ref) < FP32_RTOL


@pytest.mark.parametrize(
    "P,hq,hk,layout,chunks", [(2, 4, 2, "sbhd", 1), (4, 8, 2, "sbhd", 1), (4, 8, 8, "bshd", 1), (4, 8, 8, "sbhd", 2)]
)
def test_load_balanced_token_order(P, hq, hk, layout, chunks):
    """Megatron's dual-chunk shard: rank r holds chunks r and 2P-1-r; results equal full attention."""
    S, b, d = 16 * P, 2, 8
    q, k, v, dout, m, _ = make_inputs(3, S, b, hq, hk, d, layout, mask=True)
    sd = 0 if layout == "sbhd" else 1

    def lb_shard(t, r, world):
        ch = t.chunk(2 * world, dim=sd)
        return torch.cat([ch[r], ch[2 * world - 1 - r]], dim=sd)

    def rank_fn(rank, world):
        qs, ks, vs = (lb_shard(t, rank, world).clone().requires_grad_() for t in (q, k, v))
        out = ulysses_mcore.ulysses_attention(
            qs,
            ks,
            vs,
            group=dist.group.WORLD,
            causal=True,
            layout=layout,
            attention_mask=m,
            token_order="load_balanced",
            overlap_chunks=chunks,
        )
        out.backward(lb_shard(dout, rank, world))
        return out.detach(), qs.grad, ks.grad, vs.grad

    res = run_threaded(P, rank_fn)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True, layout=layout, attention_mask=m)
    ref.backward(dout.double())
    for i, want in enumerate((ref.detach(), qr.grad, kr.grad, vr.grad)):
        for r in range(P):
            assert rel_err(res[r][i], lb_shard(want, r, P)) < FP32_RTOL


UNEVEN = [
    # P, S, b, hq, hk, d, layout, causal, mask
    (4, 32, 2, 7, 7, 8, "sbhd", True, False),  # 7 heads at P=4: 2, 2, 2, 1
    (8, 32, 1, 20, 20, 8, "sbhd", True, True),  # 20 at P=8
    (4, 32, 2, 28, 7, 8, "sbhd", True, True),  # GQA 28 q / 7 kv: groups straddle ranks
    (4, 32, 2, 28, 7, 8, "bshd", False, False),
    (3, 24, 2, 8, 2, 8, "sbhd", True, False),  # P=3
    (4, 32, 1, 6, 1, 16, "bshd", True, False),  # MQA, 6 heads at P=4
]


@pytest.mark.parametrize("case", UNEVEN, ids=lambda c: f"P{c[0]}_q{c[3]}kv{c[4]}_{c[6]}")
def test_uneven_heads_match_reference(case):
    P, S, b, hq, hk, d, layout, causal, mask = case
    assert not heads.is_even(hq, hk, P) and heads.head_layout_error(hq, hk, P) is None
    errs = run_case(P, S, b, hq, hk, d, layout, causal, mask=mask, bias=mask)
    assert max(errs) < FP32_RTOL, errs


def test_uneven_split_and_kv_sharing():
    from ulysses_mcore.exchange.heads import HeadPlan

    p = HeadPlan(28, 7, 4)
    assert [p.q_range(r) for r in range(4)] == [(0, 7), (7, 14), (14, 21), (21, 28)]
    assert [p.kv_heads_of_rank(r) for r in range(4)] == [[0, 1], [1, 2, 3], [3, 4, 5], [5, 6]]
    assert p.kv_index_for_q(1) == [0, 1, 1, 1, 1, 2, 2]
    assert [HeadPlan(7, 7, 4).q_count(r) for r in range(4)] == [2, 2, 2, 1]
    # one plan for both: the regular (even) layouts are the uniform special case
    assert HeadPlan(8, 2, 4).regular and HeadPlan(8, 2, 4).uniform and not HeadPlan(7, 7, 4).uniform


def test_release_drops_the_prepared_calls_and_buffers():
    """ulysses_mcore.release(): the functional API's cache (which holds process groups) is emptied,
    and this thread's exchange buffers and host copies of document boundaries; the next call prepares
    again and is still exact.  A module's cache is left to its module."""
    from ulysses_mcore.attention import CALLS
    from ulysses_mcore.call import CallCache
    from ulysses_mcore.exchange.orders import BATCH, host_bounds
    from ulysses_mcore.exchange.transport import POOL

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(64, 1, 4, 32, generator=g) for _ in range(3))

    def fn(rank, world):
        shard = [t.chunk(world)[rank] for t in (q, k, v)]
        return ulysses_mcore.ulysses_attention(*shard, group=dist.group.WORLD, causal=True)

    run_threaded(2, fn)
    POOL.take((1 << 16,), torch.float32, torch.device("cpu"))  # a buffer of this thread's pool
    assert host_bounds(torch.tensor([0, 3, 8])) == (0, 3, 8)
    module_cache = CallCache()
    module_cache.entries["held"] = object()
    assert len(CALLS.entries) >= 1 and POOL.free_lists and BATCH.slots
    ulysses_mcore.release()
    assert not CALLS.entries and not POOL.free_lists and not BATCH.slots
    assert module_cache.entries  # a UlyssesAttention's prepared calls go with the model
    out = torch.cat(run_threaded(2, fn))
    assert (out.double() - reference_attention(q, k, v, causal=True)).abs().max() < 1e-5


def test_steady_state_calls_build_no_record():
    """A cached functional call is keyed by its plain choices: its call site (and options record) is
    built once, when its first signature is prepared, not on later calls."""
    from ulysses_mcore import attention

    q = torch.randn(8, 1, 2, 4)
    ulysses_mcore.release()
    built, site_of = [], attention.CALLS.site_of
    attention.CALLS.site_of = lambda choices: built.append(choices) or site_of(choices)
    try:
        outs = [ulysses_mcore.ulysses_attention(q, q, q, group=None, causal=True, window_size=[3, 1]) for _ in range(3)]
    finally:
        attention.CALLS.site_of = site_of
    assert len(built) == 1 and built[0][7] == (3, 1)  # the window list keyed as a tuple
    ref = reference_attention(q, q, q, causal=True, window_size=(3, 1))
    assert all((out.double() - ref).abs().max() < 1e-5 for out in outs)


EXIT_WORLD = """
import sys, torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
import ulysses_mcore
for s in (64, 128, 96):
    q, k, v = (torch.randn(s // 2, 1, 4, 16, requires_grad=True) for _ in range(3))
    ulysses_mcore.ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True).sum().backward()
for bad in (3, 5):  # 3 heads at degree 2: the same ValueError on both ranks
    q = torch.randn(bad, 1, 3, 16)
    try:
        ulysses_mcore.ulysses_attention(q, q, q, group=dist.group.WORLD, causal=True)
    except ValueError:
        pass
dist.destroy_process_group()  # no ulysses_mcore.release(): a user's script does not call it
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is not None, reason="one leg carries it (the abort was gloo's, any torch)")
def test_no_abort_at_exit_without_release_in_100_worlds_under_load(tmp_path):
    """100 two-rank worlds, two at a time on the 2-core machine (load), each calling the functional API
    forward and backward with several signatures (two of them raising the same ValueError on both
    ranks) and exiting without release(): every rank exits 0.  Before the package let go of its
    groups at exit, 2 of 12 such worlds died with SIGABRT."""
    import subprocess
    import sys

    from tests.helpers import free_port

    script = tmp_path / "world.py"
    script.write_text(EXIT_WORLD)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    codes = []
    for _ in range(50):
        procs = []
        for _ in range(2):  # two worlds at once
            port = str(free_port())
            procs += [
                subprocess.Popen([sys.executable, str(script), str(r), port], env=env, stderr=subprocess.PIPE)
                for r in (0, 1)
            ]
        codes += [(p.wait(timeout=120), p.stderr.read().decode()[-300:]) for p in procs]
    bad = [c for c in codes if c[0] != 0]
    assert not bad, f"{len(bad)} of {len(codes)} ranks failed: {bad[:3]}"
