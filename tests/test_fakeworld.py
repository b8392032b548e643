"""Every GPU route at cluster size on fake CUDA (ulysses_mcore.devtools.fakeworld): world 8 in one process,
bf16, 8192 tokens, head dim 128, with the default ``check=True`` -- the kernel each call takes,
forward and backward, its dtype and the all-to-all count; a planted device mismatch and a planted
host read fail the run, named with their source line (negative controls).  Skipped under a
CPU-only torch (the Python 3.12 leg's torch is a CUDA build and runs it without a GPU)."""

import pytest
import torch
import torch.distributed as dist

import ulysses_mcore
from ulysses_mcore.devtools import fakeworld as fw

pytestmark = pytest.mark.skipif(bool(fw.unavailable()), reason=fw.unavailable() or "-")
WORLD, SEQ, D = 8, 8192, 128
N = SEQ // WORLD


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def _cu(*bounds):
    return torch.tensor(bounds, device="cuda", dtype=torch.int32)


def _qkv(hq=32, hk=8, d=D, dv=None, shape=(N, 1), **kw):
    """ulysses_attention's tensors (``shape`` then heads, head dim; value head dim ``dv``) and keywords."""
    return dict(q=_t(*shape, hq, d), k=_t(*shape, hk, d), v=_t(*shape, hk, dv or d), **kw)


# route -> (keywords of ulysses_attention given the hybrid's groups, kernel expected forward, backward)
ROUTES = {
    "mha": (lambda g: _qkv(hk=32), "sdpa-flash", "sdpa-flash"),
    "gqa 32/8": (lambda g: _qkv(), "sdpa-flash", "sdpa-flash"),
    "uneven 28/7": (lambda g: _qkv(28, 7), "sdpa-flash", "sdpa-flash"),
    "bshd": (lambda g: _qkv(shape=(1, N), layout="bshd"), "sdpa-flash", "sdpa-flash"),
    "packed thd": (
        lambda g: _qkv(shape=(N,), layout="thd", cu_seqlens=_cu(0, 3000, 6000, SEQ), max_seqlen=3000),
        "torch-varlen",
        "torch-varlen",
    ),
    "window": (lambda g: _qkv(window_size=(1024, 0)), "flash-varlen", "flash-varlen"),
    "window + sinks + lse": (
        lambda g: _qkv(window_size=(1024, 0), softmax_offset=_t(32, dtype=torch.float32), return_lse=True),
        "flash-varlen",
        None,  # the lse's gradient runs the matmul engine's tiles (no fused kernel takes d lse)
    ),
    "mla (value dim 64)": (lambda g: _qkv(hk=32, d=192, dv=64), "sdpa-efficient", "sdpa-efficient"),
    "hybrid ulysses 4 x ring 2": (
        lambda g: _qkv(group=g[0], ring_group=g[1], token_order="load_balanced"),
        "flash-varlen",
        "flash-varlen",
    ),
}


@pytest.fixture(scope="module")
def world():
    with fw.fake_world(WORLD, rank=3) as mode:
        yield mode, ulysses_mcore.new_sequence_groups(ulysses=4, cp=2)


def _run(kw, groups):
    kw = dict(kw(groups))
    kw.setdefault("group", dist.group.WORLD)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with fw.SdpaAsOnGpu(), fw.KernelLog() as log:
        out = ulysses_mcore.ulysses_attention(q, k, v, causal=True, **kw)  # check=True: the default
        o = out[0] if isinstance(out, tuple) else out
        grads = fw.backward(o, torch.ones_like(o))
    return q, o, grads, log


@pytest.mark.parametrize("route", list(ROUTES))
def test_route_runs_at_world_8_with_the_default_check(world, route):
    kw, fwd, bwd = ROUTES[route]
    q, out, grads, log = _run(kw, world[1])
    assert out.shape == q.shape[:-1] + out.shape[-1:] and out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert grads[q].shape == q.shape and grads[q].dtype == q.dtype
    kernels = {c.kernel for c in log.calls if c.direction == "forward"}
    assert kernels == {fwd}, log.kernels()
    assert all(c.dtypes[0] == "bfloat16" for c in log.calls)
    back = {c.kernel for c in log.calls if c.direction == "backward"}
    assert back == ({bwd} if bwd else set()), log.kernels("backward")
    # 2 all-to-alls forward, 2 backward (the ring adds its shifts through the same primitive)
    assert log.all_to_alls == 4 or (route.startswith("hybrid") and log.all_to_alls > 4)


def _planted(kind):
    def kernel(q, k, v, *, causal, softmax_scale=None):
        if kind == "host read":
            return q * float(q.sum())  # a host read of a CUDA tensor
        return q + torch.zeros(q.shape[-1])  # a CPU tensor meets a CUDA one

    return kernel


@pytest.mark.parametrize("kind", ["host read", "device mismatch"])
def test_planted_fault_fails_the_run_naming_its_line(world, kind):
    q, k, v = _t(N, 1, 8, D), _t(N, 1, 8, D), _t(N, 1, 8, D)
    with pytest.raises(Exception) as err:
        ulysses_mcore.ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True, backend=_planted(kind))
    line = fw.finding(err.value)
    assert line is not None and line.startswith(kind) and "test_fakeworld.py" in line, line


def test_sdpa_choice_models_torch_on_a_hopper_gpu():
    q = torch.empty(1, 8, 16, 128, dtype=torch.bfloat16, device="meta")
    assert fw.sdpa_choice(q, q, q, None, 0.0, False) == "flash"
    assert fw.sdpa_choice(q, q, q, torch.empty(1, 1, 16, 16, device="meta"), 0.0, False) == "efficient"
    odd = torch.empty(1, 8, 16, 100, dtype=torch.bfloat16, device="meta")
    assert fw.sdpa_choice(odd, odd, odd, None, 0.0, False) == "math"  # 100 % 8 != 0: no fused kernel
    assert fw.sdpa_choice(q.float(), q.float(), q.float(), None, 0.0, True) == "math"


def test_flops_count_causal_attention_as_half(world):
    q, k, v = _t(1, 8, 1024, D), _t(1, 8, 1024, D), _t(1, 8, 1024, D)
    with fw.SdpaAsOnGpu(), fw.flop_counter() as causal:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with fw.SdpaAsOnGpu(), fw.flop_counter() as full:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
    assert full.get_total_flops() == 2 * 8 * 1024 * 1024 * (D + D)
    assert causal.get_total_flops() * 2 == full.get_total_flops()


def test_live_bytes_count_new_storages_not_views_of_a_parameter(world):
    """LiveBytes against bytes counted by hand: a weight's transpose and an in-place add make no
    storage; a product does, freed when it dies; the peak's holders name it by op, shape, dtype."""
    w = torch.nn.Parameter(torch.empty(1024, 4096, device="cuda", dtype=torch.bfloat16))
    x = torch.empty(2048, 4096, device="cuda", dtype=torch.bfloat16)
    live = fw.LiveBytes()
    with live:
        wt = w.t()  # a view of the parameter: no new bytes
        assert live.now == 0
        y = x @ wt  # [2048, 1024] bf16: 4 MiB
        y.add_(1.0)  # in place: none
        assert live.now == 2048 * 1024 * 2
        z = y * 2  # another 4 MiB
        del y, z
    assert live.now == 0 and live.peak == 2 * 2048 * 1024 * 2
    assert live.holders()[0].endswith("[2048, 1024] bfloat16 x 1")
