"""Tier 4: GPU backends and NCCL (skipped without CUDA, never faked).

* flash-attn and Transformer Engine kernels as the inner kernel, against float64;
* P ranks as threads on one GPU through the real exchange, with the no-host-sync check;
* with ULYSSES_GPU_WORLD=P (>= 2 GPUs; tools/device_check.sh sets it to the GPU count), the
  attention parity in an NCCL world of P.
"""

import os

import pytest
import torch

from tests.helpers import reference_attention, run_spawned

pytestmark = pytest.mark.gpu


def _inputs(S=256, b=2, hq=8, hk=2, d=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(S, b, h, d, generator=g).to(dtype) for h in (hq, hk, hk, hq)]


@pytest.mark.parametrize("backend", ["sdpa", "flash", "te"])
def test_kernel_on_gpu_matches_float64(backend):
    from ulysses_mcore import options, ulysses_attention

    if options.backend_error(backend):
        pytest.skip(options.backend_error(backend))
    q, k, v, dout = (t.cuda() for t in _inputs())
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qs, ks, vs, group=None, causal=True, backend=backend)
    out.backward(dout)
    qr, kr, vr = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True)
    ref.backward(dout.double().cpu())
    for a, r in zip((out, qs.grad, ks.grad, vs.grad), (ref, qr.grad, kr.grad, vr.grad)):
        assert ((a.double().cpu() - r).abs().max() / r.abs().max()).item() < 3e-2


def _nccl_world(rank, world, backend):
    import torch.distributed as dist

    from ulysses_mcore import ulysses_attention

    torch.cuda.set_device(rank)
    q, k, v, dout = (t.cuda() for t in _inputs(S=256 * world))
    qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qs, ks, vs, group=dist.group.WORLD, causal=True, backend=backend)
    out.backward(dout.chunk(world)[rank])
    qr, kr, vr = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True)
    ref.backward(dout.double().cpu())
    errs = []
    for a, r in zip((out, qs.grad, ks.grad, vs.grad), (ref, qr.grad, kr.grad, vr.grad)):
        r = r.chunk(world)[rank]
        errs.append(((a.double().cpu() - r).abs().max() / r.abs().max()).item())
    return max(errs)


@pytest.mark.skipif(
    int(os.environ.get("ULYSSES_GPU_WORLD", "0")) < 2, reason="set ULYSSES_GPU_WORLD=P on a node with P GPUs"
)
def test_nccl_world():
    P = int(os.environ["ULYSSES_GPU_WORLD"])
    if torch.cuda.device_count() < P:
        pytest.skip(f"needs {P} GPUs")
    os.environ["ULYSSES_TEST_BACKEND"] = "nccl"
    assert max(run_spawned(P, _nccl_world, "sdpa")) < 3e-2


@pytest.mark.parametrize("backend", ["sdpa", "flash", "te"])
def test_packed_varlen_kernel_on_gpu_matches_float64(backend):
    """THD with global cu_seqlens on one GPU (group of one): the varlen path of each kernel."""
    from ulysses_mcore import options, ulysses_attention
    from ulysses_mcore.megatron.layer.batch import document_mask

    if options.backend_error(backend):
        pytest.skip(options.backend_error(backend))
    q, k, v, dout = (t[:, 0].cuda() for t in _inputs(S=512, b=1))
    cu = torch.tensor([0, 100, 101, 333, 512], dtype=torch.int32)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qs, ks, vs, group=None, causal=True, backend=backend, layout="thd", cu_seqlens=cu)
    out.backward(dout)
    qr, kr, vr = (t.double().cpu().unsqueeze(1).requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True, attention_mask=document_mask(cu, 512))
    ref.backward(dout.double().cpu().unsqueeze(1))
    for a, r in zip((out, qs.grad, ks.grad, vs.grad), (ref, qr.grad, kr.grad, vr.grad)):
        r = r.squeeze(1)
        assert ((a.double().cpu() - r).abs().max() / r.abs().max()).item() < 3e-2


def _nccl_hybrid_world(rank, world, backend):
    """Ulysses 2 x ring (world / 2) on NCCL: the LSE ring (sdpa) or TE's p2p ring (te)."""
    from ulysses_mcore import new_sequence_groups, ulysses_attention
    from ulysses_mcore.kernels.ring import ring_segments

    torch.cuda.set_device(rank)
    ug, rg = new_sequence_groups(2, world // 2)
    S = 256 * world
    q, k, v, dout = (t.cuda() for t in _inputs(S=S))

    def shard(t):
        return torch.cat([t[s : s + n] for s, n in ring_segments(rank, world, S, "load_balanced")])

    qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(
        qs, ks, vs, group=ug, ring_group=rg, causal=True, backend=backend, token_order="load_balanced"
    )
    out.backward(shard(dout))
    qr, kr, vr = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True)
    ref.backward(dout.double().cpu())
    errs = []
    for a, r in zip((out, qs.grad, ks.grad, vs.grad), (ref, qr.grad, kr.grad, vr.grad)):
        r = shard(r)
        errs.append(((a.double().cpu() - r).abs().max() / r.abs().max()).item())
    return max(errs)


@pytest.mark.skipif(
    int(os.environ.get("ULYSSES_GPU_WORLD", "0")) < 4, reason="set ULYSSES_GPU_WORLD=4 on a node with 4+ GPUs"
)
@pytest.mark.parametrize("backend", ["sdpa", "te"])
def test_nccl_hybrid_world(backend):
    from ulysses_mcore import options

    if options.backend_error(backend):
        pytest.skip(options.backend_error(backend))
    P = int(os.environ["ULYSSES_GPU_WORLD"])
    if torch.cuda.device_count() < P:
        pytest.skip(f"needs {P} GPUs")
    os.environ["ULYSSES_TEST_BACKEND"] = "nccl"
    assert max(run_spawned(P, _nccl_hybrid_world, backend)) < 3e-2


THREADED_CASES = {  # name: (hq, hk, options, packed)
    "gqa": (8, 2, {}, False),
    "uneven-heads": (7, 7, {}, False),  # 7 heads over P = 2: 4 and 3; P = 4: 28 q / 7 kv, groups straddle ranks
    "overlap": (16, 8, {"overlap_chunks": 2}, False),
    "packed-per-document": (8, 2, {"token_order": "per_document"}, True),
}


@pytest.mark.parametrize("case", list(THREADED_CASES))
@pytest.mark.parametrize("P", [2, 4])
def test_threaded_world_on_one_gpu_matches_float64_without_host_syncs(P, case):
    """P ranks as threads on one GPU (the threaded backend moves CUDA tensors) through the real
    exchange: GQA, an uneven head plan, overlap, and packed documents with GPU ``cu_seqlens`` in
    Megatron-LM's per-document order (bf16 there: torch's varlen kernel); against float64 on the
    CPU.  Calls after the first (which validates once) run under
    ``torch.cuda.set_sync_debug_mode("error")``, switched once for all threads between barriers
    (the mode is process-wide): no device-to-host sync forward or backward."""
    import threading

    import torch.distributed as dist

    from tests.helpers import run_threaded
    from ulysses_mcore import ulysses_attention

    hq, hk, opts, packed = THREADED_CASES[case]
    if case == "uneven-heads" and P == 4:
        hq, hk = 28, 7
    dtype = torch.bfloat16 if packed else torch.float32
    S = 64 * P
    full = [t.to(dtype).cuda() for t in _inputs(S=S, b=1 if packed else 2, hq=hq, hk=hk)]
    cu = None
    if packed:  # documents padded to multiples of 2P, dealt out per document (Megatron-LM's THD)
        cu = torch.tensor([0, 4 * P, 20 * P, 36 * P, S], dtype=torch.int32, device="cuda")
        full = [t[:, 0] for t in full]
    gate = threading.Barrier(P)

    def shard(t, rank):
        if not packed:
            return t.chunk(P)[rank]
        from ulysses_mcore.exchange.orders import per_document_order

        order = per_document_order(cu, P, S)
        return t[order].chunk(P)[rank]

    def fn(rank, world):
        torch.cuda.set_device(0)
        kw = dict(group=dist.group.WORLD, causal=True, **opts)
        if packed:
            kw.update(layout="thd", cu_seqlens=cu, max_seqlen=S)
        for step in range(3):
            if step == 1:  # the first call validated and prepared: now no sync may happen
                if gate.wait() == 0:
                    torch.cuda.set_sync_debug_mode("error")
                gate.wait()
            qs, ks, vs = (shard(t, rank).clone().requires_grad_() for t in full[:3])
            out = ulysses_attention(qs, ks, vs, **kw)
            out.backward(shard(full[3], rank))
        gate.wait()
        if rank == 0:
            torch.cuda.set_sync_debug_mode("default")
        return [t.detach().double().cpu() for t in (out, qs.grad, ks.grad, vs.grad)]

    try:
        res = run_threaded(P, fn)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    qr, kr, vr = (t.double().cpu().requires_grad_() for t in full[:3])
    mask = None
    if packed:
        from ulysses_mcore.megatron.layer.batch import document_mask

        qr, kr, vr = (t.detach().unsqueeze(1).requires_grad_() for t in (qr, kr, vr))
        mask = document_mask(cu.cpu(), S)
    ref = reference_attention(qr, kr, vr, causal=True, attention_mask=mask)
    ref.backward(full[3].double().cpu().reshape(ref.shape))
    tol = 3e-2 if packed else 1e-4
    for i, r in enumerate((ref, qr.grad, kr.grad, vr.grad)):
        r = r.squeeze(1) if packed else r
        got = torch.cat([res[rank][i] for rank in range(P)])
        if packed:
            from ulysses_mcore.exchange.orders import per_document_order

            got = got[torch.argsort(per_document_order(cu, P, S)).cpu()]
        assert ((got - r).abs().max() / r.abs().max()).item() < tol, (case, i)


GPU_VARIANTS = [  # backend, options: each kernel with what it supports natively (docs/variants.md)
    ("sdpa", dict(window_size=(32, 0))),
    ("flash", dict(window_size=(32, 0))),
    ("te", dict(window_size=(32, 0))),
    ("sdpa", dict(dv=32)),
    ("te", dict(dv=32)),
    ("sdpa", dict(softmax_offset=True, return_lse=True, window_size=(48, 0))),
    ("sdpa", dict(softmax_offset=True)),  # the engine's blocks through torch's CUDA flash kernel, fwd and bwd
]


@pytest.mark.parametrize("backend,opts", GPU_VARIANTS, ids=[f"{b}-{'-'.join(o)}" for b, o in GPU_VARIANTS])
def test_variant_kernels_on_gpu_match_float64(backend, opts):
    """MLA, sliding windows, sinks and the lse through each GPU kernel, bf16, against float64."""
    from ulysses_mcore import options, ulysses_attention

    if options.backend_error(backend):
        pytest.skip(options.backend_error(backend))
    opts = dict(opts)
    q, k, v, _ = (t.cuda() for t in _inputs())
    if opts.pop("dv", None):
        v = v[..., :32].contiguous()
    dout = torch.randn(*q.shape[:3], v.shape[-1], device="cuda", dtype=q.dtype)
    sink = (
        torch.linspace(-1, 1, q.shape[2], device="cuda").requires_grad_() if opts.pop("softmax_offset", False) else None
    )
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    res = ulysses_attention(qs, ks, vs, group=None, causal=True, backend=backend, softmax_offset=sink, **opts)
    out, lse = res if opts.get("return_lse") else (res, None)
    (out.float() * dout.float()).sum().add(lse.sum() if lse is not None else 0).backward()
    qr, kr, vr = (t.double().cpu().requires_grad_() for t in (q, k, v))
    sr = sink.detach().double().cpu().requires_grad_() if sink is not None else None
    ro, rl = reference_attention(
        qr, kr, vr, causal=True, window_size=opts.get("window_size"), softmax_offset=sr, return_lse=True
    )
    ((ro * dout.double().cpu()).sum() + (rl.sum() if lse is not None else 0)).backward()
    pairs = [(out, ro), (qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)]
    if lse is not None:
        pairs += [(lse, rl), (sink.grad, sr.grad)]
    for a, r in pairs:
        assert ((a.double().cpu() - r).abs().max() / r.abs().max()).item() < 3e-2


@pytest.mark.parametrize("order", ["load_balanced", "contiguous"])
def test_threaded_hybrid_ring_on_one_gpu_matches_float64(order):
    """Ulysses 2 x ring 2 as four threads on one GPU, bf16: the ring's blocks through torch's CUDA
    flash kernel (input dtype, fp32 merge), its shifts between threads; against float64."""
    from tests.helpers import run_threaded
    from tests.test_ring import hybrid_groups, shard
    from ulysses_mcore import ulysses_attention

    U, C, S = 2, 2, 512
    q, k, v, dout = (t.cuda() for t in _inputs(S=S, b=1, hq=8, hk=2))

    def fn(rank, world):
        torch.cuda.set_device(0)
        ug, rg = hybrid_groups(rank, U, C)
        c = rank % U + U * (rank // U)
        qs, ks, vs = (shard(t, c, U * C, order, 0).clone().requires_grad_() for t in (q, k, v))
        out = ulysses_attention(qs, ks, vs, group=ug, ring_group=rg, causal=True, token_order=order)
        out.backward(shard(dout, c, U * C, order, 0))
        return [t.detach().double().cpu() for t in (out, qs.grad, ks.grad, vs.grad)]

    res = run_threaded(U * C, fn)
    qr, kr, vr = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=True)
    ref.backward(dout.double().cpu())
    for i, r in enumerate((ref, qr.grad, kr.grad, vr.grad)):
        for rank in range(U * C):
            want = shard(r, rank, U * C, order, 0)
            assert ((res[rank][i] - want).abs().max() / r.abs().max()).item() < 3e-2, (i, rank)
