"""GPU-ready by construction, checked here on the CPU (issue 25): what would crash or crawl on a
GPU is visible on the CPU as a tensor made without a device, an fp32 GEMM in a bf16 run, or a
read of a tensor's value on the host in a steady-state call.

* a walk of the package's source: every tensor factory on a path that runs per call names its
  device (a short, explicit allow-list for the rest);
* a dispatch-level recorder of GEMMs: a bf16 ring, chunked loss and exchange run no fp32 GEMM
  bigger than one tile;
* a counter of host reads (``.item``, ``.tolist``, ``int()`` / ``bool()`` / ``float()`` of a
  tensor, ``.cpu()``): zero in every layer's call after the first of a packed micro-batch, two
  (the sdpa kernel's boundaries and lengths, host tensors here) in a new micro-batch's first layer.
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import count_collectives, reference_attention, run_threaded

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {
    "arange",
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "randn",
    "rand",
    "randint",
    "linspace",
    "eye",
    "empty_strided",
}
# (file, function): factories that never run per call, each with its reason
HOST_SIDE = {
    (
        "ulysses_mcore/megatron/layer/batch.py",
        "document_boundaries",
    ): "data path: host batches, moved by training.to_device",
    ("ulysses_mcore/megatron/trainer/data.py", "write_indexed_dataset"): "preprocessing on the host",
    ("ulysses_mcore/megatron/trainer/data.py", "microbatches"): "data path: host batches, moved by training.to_device",
    ("ulysses_mcore/megatron/trainer/dryrun.py", "_batch"): "dry run: a host batch, moved by training.to_device",
    ("ulysses_mcore/megatron/trainer/dryrun.py", "_dynamic_cell"): "dry run: a host cell, moved by training.to_device",
    (
        "ulysses_mcore/megatron/trainer/dynamic.py",
        "_cell",
    ): "data path: a cell's host batch, moved by training.to_device",
    ("ulysses_mcore/megatron/layer/module.py", "_sinks"): "build time: moved with the model by build_gpt",
    ("ulysses_mcore/megatron/layer/module.py", "_initial_sinks"): "build time: moved with the model by build_gpt",
    ("ulysses_mcore/megatron/trainer/training.py", "init_layout_independent"): "build time: host draw, copied",
    ("ulysses_mcore/megatron/trainer/errors.py", "nonfinite_report"): "once per step: a host flag, moved",
    ("ulysses_mcore/megatron/trainer/training.py", "_loss_on_all_ranks"): "once per step: host loss values",
    ("ulysses_mcore/megatron/trainer/loop.py", "_exit_reason"): "once per iteration: a host flag, moved",
}


def _factories_without_device(root=ROOT):
    paths = [p for pkg in ("ulysses_mcore", "megatron_patches") for p in sorted((root / pkg).rglob("*.py"))]
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                f = getattr(node, "func", None)
                if (
                    isinstance(node, ast.Call)
                    and isinstance(f, ast.Attribute)
                    and f.attr in FACTORIES
                    and isinstance(f.value, ast.Name)
                    and f.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)
                ):
                    yield rel, fn.name, node.lineno, f.attr


def test_every_tensor_factory_on_a_per_call_path_names_its_device():
    found = list(_factories_without_device())
    stray = [f"{rel}:{line} torch.{what} in {fn}()" for rel, fn, line, what in found if (rel, fn) not in HOST_SIDE]
    assert not stray, "tensor factories without device= on a per-call path:\n" + "\n".join(stray)
    used = {(rel, fn) for rel, fn, _, _ in found}
    assert not set(HOST_SIDE) - used, f"allow-list entries no longer needed: {set(HOST_SIDE) - used}"


def test_the_walk_catches_a_factory_without_a_device(tmp_path):
    """The negative control: a per-call function with ``torch.arange(n)`` is reported, one with
    ``device=`` is not."""
    pkg = tmp_path / "ulysses_mcore"
    pkg.mkdir()
    (pkg / "x.py").write_text(
        "import torch\ndef per_call(n):\n    return torch.arange(n)\n"
        "def fine(n, d):\n    return torch.arange(n, device=d)\n"
    )
    assert list(_factories_without_device(tmp_path)) == [("ulysses_mcore/x.py", "per_call", 3, "arange")]


# ----------------------------------------------------------------------------- GEMMs by dtype
GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmm_"}


class GemmRecorder(TorchDispatchMode):
    """Every GEMM aten runs: (op, dtype, M, N) with M, N the output's last two dims."""

    def __init__(self):
        super().__init__()
        self.gemms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in GEMMS:
            self.gemms.append((name, out.dtype, out.shape[-2], out.shape[-1]))
        return out

    def fp32_over(self, size: int):
        return [g for g in self.gemms if g[1] == torch.float32 and max(g[2], g[3]) > size]


def _bf16(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(torch.bfloat16).requires_grad_() for s in shapes]


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_ring_runs_no_fp32_gemm_beyond_a_tile(packed):
    """The single-rank engine of the ring (the sdpa backend's kernel for windows / sinks / lse): plain
    blocks go through the fused kernel in bf16 (no fp32 GEMM at all); documents (masks inside blocks)
    through the fp32 engine one tile at a time."""
    from ulysses_mcore.options import LSE_TILE
    from ulysses_mcore.kernels.ring import ring_attention

    S = 2 * LSE_TILE + 64
    q, k, v = _bf16((S, 1, 4, 32), (S, 1, 2, 32), (S, 1, 2, 32))
    cu = torch.tensor([0, 100, 700, S], dtype=torch.int32) if packed else None
    with GemmRecorder() as rec:
        out = ring_attention(q, k, v, group=None, causal=True, cu_seqlens=cu, softmax_offset=None)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    assert not rec.fp32_over(LSE_TILE), rec.fp32_over(LSE_TILE)[:3]
    if not packed:
        assert not [g for g in rec.gemms if g[1] == torch.float32]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = None
    if packed:
        from ulysses_mcore.megatron.layer.batch import document_mask

        mask = document_mask(cu, S)
    ref = reference_attention(qr, kr, vr, causal=True, attention_mask=mask)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_bf16_chunked_loss_runs_its_gemms_in_bf16():
    from ulysses_mcore.megatron.layer.memory import ChunkedLinearCrossEntropy

    h, w = _bf16((96, 32), (200, 32))
    labels = torch.randint(0, 200, (96,), generator=torch.Generator().manual_seed(1))
    with GemmRecorder() as rec:
        loss = ChunkedLinearCrossEntropy.apply(h, w, labels, 32, (None, 0))
        loss.sum().backward()
    assert rec.gemms and all(g[1] == torch.bfloat16 for g in rec.gemms), rec.gemms
    assert w.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.bfloat16
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hr @ wr.t(), labels, reduction="none")
    ref.sum().backward()
    assert ((loss.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    for got, want in ((h.grad, hr.grad), (w.grad, wr.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 3e-2


def test_bf16_exchange_keeps_bf16_and_runs_no_gemm():
    from ulysses_mcore import ulysses_attention

    full = _bf16((32, 1, 4, 16), (32, 1, 2, 16), (32, 1, 2, 16))

    def fn(rank, world):
        q, k, v = (t.detach().chunk(world)[rank].clone().requires_grad_() for t in full)
        with GemmRecorder() as rec:
            out = ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True)
            out.float().sum().backward()
        return out.dtype, q.grad.dtype, [g for g in rec.gemms if g[1] == torch.float32]

    for out_dtype, grad_dtype, fp32 in run_threaded(2, fn):
        assert out_dtype == grad_dtype == torch.bfloat16 and not fp32


# ----------------------------------------------------------------------------- host reads
class HostReads(TorchFunctionMode):
    """Reads of a tensor's values on the host (each a device-to-host sync on a GPU)."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _psp(cu_real, cu_pad, max_len):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


BATCHES = [  # Megatron-LM's per-document THD layout at P = 2: documents padded to multiples of 4
    (torch.tensor([0, 5, 16, 19], dtype=torch.int32), torch.tensor([0, 8, 20, 24], dtype=torch.int32), 12),
    (torch.tensor([0, 13, 18], dtype=torch.int32), torch.tensor([0, 16, 24], dtype=torch.int32), 16),
]


def test_steady_state_packed_layers_read_nothing_on_the_host():
    """Two layers (two modules, each validating its first call) and three micro-batches with
    different documents, in a threaded world of 2: after the first micro-batch no call validates
    again (no collective but the two all-to-alls), a later layer of a micro-batch reads nothing on
    the host, and a new micro-batch's first layer reads twice (the sdpa kernel's per-document loop
    on the CPU: boundaries and real lengths of host tensors; on a GPU in bf16 / fp16 the sdpa
    backend runs torch's varlen kernel, and flash / TE read nothing either)."""
    from megatron.core.transformer.enums import AttnMaskType

    from tests.test_module import config
    from ulysses_mcore import UlyssesAttention

    heads, d = 4, 8
    cfg = config(heads, heads, hidden=heads * d, context_parallel_size=2)
    g = torch.Generator().manual_seed(3)
    inputs = {T: [torch.randn(T // 2, heads, d, generator=g) for _ in range(3)] for T in (24, 24)}

    def fn(rank, world):
        layers = [UlyssesAttention(cfg, n, AttnMaskType.padding_causal, ulysses_group=dist.group.WORLD) for n in (1, 2)]
        seen = []
        for cu_real, cu_pad, max_len in BATCHES + BATCHES[:1]:
            psp = _psp(cu_real.clone(), cu_pad.clone(), max_len)  # a new micro-batch: new tensors
            for layer in layers:
                before = (coll.get("all_gather_object"), coll.get("all_to_all_single"))
                with HostReads() as reads:
                    layer(*inputs[24], None, packed_seq_params=psp)
                seen.append(
                    (
                        len(reads.reads),
                        coll.get("all_gather_object") - before[0],
                        coll.get("all_to_all_single") - before[1],
                    )
                )
        return seen

    with count_collectives() as coll:
        res = run_threaded(2, fn)
    for seen in res:
        assert [s[1] for s in seen[:2]] == [1, 1]  # each layer validates its first call (one exchange of records)
        for first_layer, later_layer in (seen[2:4], seen[4:6]):
            # the sdpa kernel's host boundaries and real lengths of the new micro-batch (CPU tensors here)
            assert first_layer == (2, 0, 2)
            assert later_layer == (0, 0, 2)


def test_max_seqlen_from_packed_seq_params_reaches_the_kernel():
    """Megatron's host ``max_seqlen_q`` is handed to the kernel (so flash / TE never read it off
    the device), and the call reads nothing itself: a recording kernel in the module's place."""
    from ulysses_mcore.call import CallCache
    from ulysses_mcore.options import CallTensors, call_site

    got = []

    def kernel(q, k, v, **kw):
        got.append({n: kw.get(n) for n in ("cu_seqlens", "max_seqlen", "causal")})
        return torch.zeros(*q.shape[:3], v.shape[3])

    cache = CallCache()
    site = call_site(True, layout="thd", check=False, kernel=kernel)
    q = torch.randn(24, 4, 8)
    for cu, max_len in ((BATCHES[0][1], 12), (BATCHES[1][1], 16)):
        with HostReads() as reads:
            cache.run(q, q, q, site, CallTensors(cu_seqlens=cu, max_seqlen=max_len))
        assert reads.reads == []
    assert [g["max_seqlen"] for g in got] == [12, 16] and got[1]["cu_seqlens"] is BATCHES[1][1]


def test_ring_reads_packed_boundaries_once_per_micro_batch():
    """Ulysses 2 x ring 2 on packed documents (threads): the ring's block skipping reads the
    boundaries on the host once per micro-batch -- a later layer's call with the same
    ``cu_seqlens`` reads nothing -- and the result is exact."""
    from tests.test_ring import hybrid_groups, shard
    from ulysses_mcore import ulysses_attention
    from ulysses_mcore.megatron.layer.batch import document_mask

    S = 64
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(S, 4, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 10, 37, 64], dtype=torch.int32)

    def fn(rank, world):
        ug, rg = hybrid_groups(rank, 2, 2)
        qs, ks, vs = (shard(t, rank, world, "load_balanced", 0) for t in (q, k, v))
        kw = dict(group=ug, ring_group=rg, causal=True, layout="thd", token_order="load_balanced", max_seqlen=S)
        reads, first, second = [], cu.clone(), cu.clone()
        for cu_now in (first, first, second, second):  # micro-batch, its next layer, a new micro-batch, ...
            with HostReads() as r:
                out = ulysses_attention(qs, ks, vs, cu_seqlens=cu_now, **kw)
            reads.append(len(r.reads))
        return reads, out

    res = run_threaded(4, fn)
    ref = reference_attention(
        *(t.double().unsqueeze(1) for t in (q, k, v)), causal=True, attention_mask=document_mask(cu, S)
    ).squeeze(1)
    for rank, (reads, out) in enumerate(res):
        assert reads[1] == reads[3] == 0 and reads[2] == 1, reads  # reads[0]: the first call also validates
        want = shard(ref, rank, 4, "load_balanced", 0)
        assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
