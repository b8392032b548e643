"""Fake CUDA at cluster size: every GPU route run in one process without a GPU.

Under torch's ``FakeTensorMode`` a tensor on ``"cuda"`` holds a shape, a dtype and a device but no
values, and CUDA-only kernels (flash attention, varlen, GEMMs) run for their output shapes; torch's
``"fake"`` process group (``FakeStore``) answers collectives at any world size in one process.  So a
GPU route can be run at the size of the cluster it is meant for, on a laptop, and what would break on
the first GPU run shows up here:

* a device mismatch (a CPU tensor meeting a CUDA one) raises ``FakeTensorDeviceMismatchError``;
* a host read of a CUDA tensor (``.item()``, ``.tolist()``, ``int()``) raises
  ``DataDependentOutputException`` -- a run that finishes had none;
* the kernels each call took (:class:`KernelLog`) and the all-to-all bytes;
* FLOPs (``FlopCounterMode``, causal attention counted as the half it computes) and memory
  (torch's ``MemTracker``).

No numerics: fake tensors hold no values.  Needs the CUDA build of torch (CI's Python 3.12 leg
installs it); :func:`unavailable` says why not otherwise.

Two things of a real GPU cannot be had without one, and are modelled here, by name:

* torch's SDPA picks its kernel from the device's properties, so without a GPU it falls back to
  the unfused math path.  :class:`SdpaAsOnGpu` stands in for the choice torch makes on a
  Hopper GPU (flash for fp16 / bf16 without a mask, head dims up to 256 in multiples of 8;
  memory-efficient with a mask or fp32; else math) and calls that fused kernel directly;
* the autograd engine refuses a backward on fake CUDA without a device, so :func:`backward` walks
  the graph itself and calls each node's backward (the backward kernels run on the forward's saved
  tensors, as on a GPU).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .options import flash_takes_head_dim

aten = torch.ops.aten


def unavailable() -> str:
    """Why fake CUDA cannot run in this process ("" if it can)."""
    if torch.version.cuda is None:
        return (
            f"fake CUDA needs the CUDA build of torch (this is {torch.__version__}, a CPU build): "
            "install torch==2.13.0 on Python 3.12 (a CUDA build there) -- no GPU is needed"
        )
    return ""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` ranks (this process is ``rank``) and a fake tensor
    mode; yields the mode.  Refuses to replace a process group already initialised."""
    # torch's fake-tensor and fake-group internals load only for a dry run
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    why = unavailable()
    if why:
        raise RuntimeError(why)
    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- SDPA as on a GPU
def sdpa_choice(q, k, v, attn_mask, dropout_p: float, enable_gqa: bool) -> str:
    """The kernel torch's SDPA takes for this call on a Hopper GPU (``flash`` / ``efficient`` /
    ``math``), modelled from torch's own constraints (``sdp_utils``): flash for fp16 / bf16 without
    a mask, head dims <= 256 and a multiple of 8 (q, k, v alike); memory-efficient for a mask or
    fp32 when the kv heads equal the query heads; math otherwise."""
    d, dv = q.shape[-1], v.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    dims_ok = d == dv and flash_takes_head_dim(d)
    if half and attn_mask is None and dims_ok:
        return "flash"
    if not enable_gqa and d % 8 == 0 and dv % 8 == 0 and q.shape[1] == k.shape[1]:
        return "efficient"
    return "math"


def _flash_sdpa(q, k, v, dropout_p, is_causal, scale):
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]


def _efficient_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale):
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # SDPA's boolean mask: True = attend
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


class SdpaAsOnGpu(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on CUDA tensors through the fused kernel a GPU would take
    (:func:`sdpa_choice`), called directly; other calls pass through.  ``choices`` counts them."""

    def __init__(self):
        super().__init__()
        self.choices: Dict[str, int] = defaultdict(int)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or args[0].device.type != "cuda":
            return func(*args, **kwargs)
        q, k, v = args[:3]
        p = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
        p.update(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:]), **kwargs)
        choice = sdpa_choice(q, k, v, p["attn_mask"], p["dropout_p"], p["enable_gqa"])
        self.choices[choice] += 1
        if choice == "flash":
            return _flash_sdpa(q, k, v, p["dropout_p"], p["is_causal"], p["scale"])
        if choice == "efficient":
            return _efficient_sdpa(q, k, v, p["attn_mask"], p["dropout_p"], p["is_causal"], p["scale"])
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- what ran
ATTENTION_OPS = {  # aten overload packet name -> the kernel's name in reports
    "_scaled_dot_product_flash_attention": "sdpa-flash",
    "_scaled_dot_product_efficient_attention": "sdpa-efficient",
    "_scaled_dot_product_cudnn_attention": "sdpa-cudnn",
    "_flash_attention_forward": "flash-varlen",
    "_efficient_attention_forward": "efficient-varlen",
    "_varlen_attn": "torch-varlen",
    "_safe_softmax": "math (unfused softmax)",
    "_softmax": "math (unfused softmax)",
}
BACKWARD_OPS = {
    "_scaled_dot_product_flash_attention_backward": "sdpa-flash",
    "_scaled_dot_product_efficient_attention_backward": "sdpa-efficient",
    "_scaled_dot_product_cudnn_attention_backward": "sdpa-cudnn",
    "_flash_attention_backward": "flash-varlen",
    "_efficient_attention_backward": "efficient-varlen",
    "_varlen_attn_backward": "torch-varlen",
    "_softmax_backward_data": "math (unfused softmax)",
}
ALL_TO_ALL = "alltoall_base_"


@dataclass
class KernelCall:
    kernel: str
    direction: str  # "forward" / "backward"
    dtypes: tuple
    shape: tuple  # the query's (or the op's first tensor's)


@dataclass
class KernelLog(TorchDispatchMode):
    """Records every attention kernel (forward and backward) and the bytes of every all-to-all."""

    calls: List[KernelCall] = field(default_factory=list)
    all_to_all_bytes: int = 0
    all_to_alls: int = 0

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for table, direction in ((ATTENTION_OPS, "forward"), (BACKWARD_OPS, "backward")):
            if name in table:
                dtypes = tuple(str(t.dtype).replace("torch.", "") for t in tensors[:3])
                self.calls.append(KernelCall(table[name], direction, dtypes, tuple(tensors[0].shape)))
        if name == ALL_TO_ALL:
            self.all_to_alls += 1
            self.all_to_all_bytes += tensors[1].numel() * tensors[1].element_size()  # the input
        return func(*args, **(kwargs or {}))

    def kernels(self, direction: str = "forward") -> Dict[str, int]:
        out: Dict[str, int] = defaultdict(int)
        for c in self.calls:
            if c.direction == direction:
                out[f"{c.kernel} ({'/'.join(sorted(set(c.dtypes)))})"] += 1
        return dict(out)


# ----------------------------------------------------------------------------- FLOPs
def _attention_flops(b, h, sq, sk, d, dv, causal: bool) -> int:
    """QK^T and PV of one attention, multiply-adds counted twice; causal computes about half."""
    full = 2 * b * h * sq * sk * (d + dv)
    return full // 2 if causal and sq == sk else full


def _sdpa_flops(q_shape, k_shape, v_shape, causal):
    b, h, sq, d = q_shape
    return _attention_flops(b, h, sq, k_shape[2], d, v_shape[-1], causal)


def _varlen_flops(q, cum_q, max_q, causal, v_dim, docs: Optional[List[int]]):
    """Packed documents: each document attends to itself (the boundaries' values are unknown on
    fake tensors, so ``docs`` -- the document lengths the caller packed -- count; else the longest
    document stands for all, an upper bound)."""
    t, h, d = q
    lens = docs if docs else [max_q] * max(1, t // max(1, max_q))
    return sum(_attention_flops(1, h, n, n, d, v_dim, causal) for n in lens)


def flop_mapping(docs: Optional[List[int]] = None) -> dict:
    """``FlopCounterMode(custom_mapping=...)`` for the attention kernels: causal counted as half,
    packed documents each on their own (``docs``: the packed document lengths, when known)."""

    def flash_sdpa(q, k, v, dropout_p=0.0, is_causal=False, *a, out_shape=None, **kw):
        return _sdpa_flops(q, k, v, is_causal)

    def eff_sdpa(q, k, v, bias=None, lse=False, dropout_p=0.0, is_causal=False, *a, out_shape=None, **kw):
        return _sdpa_flops(q, k, v, is_causal)

    def flash_bwd(grad, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, *a, out_shape=None, **kw):
        return 2 * _sdpa_flops(q, k, v, is_causal)

    def eff_bwd(grad, q, k, v, bias, out, lse, dropout_p, grad_bias, is_causal=False, *a, out_shape=None, **kw):
        return 2 * _sdpa_flops(q, k, v, is_causal)

    def varlen_fwd(q, k, v, cq, ck, mq, mk, dropout_p, is_causal, *a, out_shape=None, **kw):
        return _varlen_flops(q, cq, mq, is_causal or kw.get("window_size_right") == 0, v[-1], docs)

    def varlen_bwd(grad, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, *a, out_shape=None, **kw):
        return 2 * _varlen_flops(q, cq, mq, is_causal or kw.get("window_size_right") == 0, v[-1], docs)

    def torch_varlen(q, k, v, cq, ck, mq, mk, is_causal=False, *a, out_shape=None, **kw):
        return _varlen_flops(q, cq, mq, is_causal, v[-1], docs)

    def torch_varlen_bwd(grad, q, k, v, out, lse, cq, ck, mq, mk, is_causal, *a, out_shape=None, **kw):
        return 2 * _varlen_flops(q, cq, mq, is_causal, v[-1], docs)

    table = {}
    if _varlen_op("_varlen_attn") is not None:  # torch.nn.attention.varlen's custom ops
        table = {_varlen_op("_varlen_attn"): torch_varlen, _varlen_op("_varlen_attn_backward"): torch_varlen_bwd}
    return table | {
        aten._scaled_dot_product_flash_attention: flash_sdpa,
        aten._scaled_dot_product_efficient_attention: eff_sdpa,
        aten._scaled_dot_product_flash_attention_backward: flash_bwd,
        aten._scaled_dot_product_efficient_attention_backward: eff_bwd,
        aten._flash_attention_forward: varlen_fwd,
        aten._flash_attention_backward: varlen_bwd,
    }


def _varlen_op(name: str):
    try:
        import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn's ops
    except ImportError:
        return None
    return getattr(torch.ops.torch_attn, name, None)


def flop_counter(docs: Optional[List[int]] = None):
    from torch.utils.flop_counter import FlopCounterMode  # a dry run's FLOP count only

    return FlopCounterMode(display=False, custom_mapping=flop_mapping(docs))


# ----------------------------------------------------------------------------- backward
def backward(output: torch.Tensor, grad: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """The backward of ``output`` without the autograd engine (which needs a device): the graph's
    nodes in reverse topological order, each called on the gradients of its outputs (custom
    ``autograd.Function`` nodes through their ``backward``).  Returns ``{leaf: gradient}``."""
    with torch.no_grad():  # as the engine runs a backward without create_graph
        return _run_backward(output, grad)


def _run_backward(output, grad):
    order = _topological(output.grad_fn)
    grads: Dict[tuple, torch.Tensor] = {(output.grad_fn, 0): grad}
    leaves: Dict[torch.Tensor, torch.Tensor] = {}
    for node in reversed(order):
        if type(node).__name__ == "AccumulateGrad":
            if (node, 0) in grads:
                leaves[node.variable] = grads[(node, 0)]
            continue
        n_out = len(getattr(node, "_input_metadata", ())) or 1
        ins = [grads.pop((node, i), None) for i in range(n_out)]
        if all(g is None for g in ins):
            continue
        outs = node(*ins) if callable(node) else type(node)._forward_cls.backward(node, *ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for (nxt, idx), g in zip(node.next_functions, outs):
            if nxt is None or g is None:
                continue
            key = (nxt, idx)
            grads[key] = g if key not in grads else grads[key] + g
    return leaves


def _topological(root) -> list:
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        if node is None:
            continue
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack += [(nxt, False) for nxt, _ in node.next_functions if nxt is not None and nxt not in seen]
    return order


# ----------------------------------------------------------------------------- findings
HOST_READ = "DataDependentOutputException"
_NOT_THE_SOURCE = (
    "/ulysses_mcore/fakeworld.py",
    "/ulysses_mcore/megatron/compat/fake_cuda.py",
)  # the stand-ins' frames
DEVICE_MISMATCH = "FakeTensorDeviceMismatchError"


def finding(exc: BaseException) -> Optional[str]:
    """A host read or a device mismatch as one line naming its source (the innermost frame outside
    torch), or ``None`` for another exception."""
    kind = type(exc).__name__
    if kind not in (HOST_READ, DEVICE_MISMATCH):
        return None
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" not in f.filename and not f.filename.endswith(_NOT_THE_SOURCE)
    ]
    where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "torch internals"
    what = "host read of a CUDA tensor" if kind == HOST_READ else "device mismatch"
    return f"{what} at {where}: {exc}"


__all__ = [
    "KernelLog",
    "SdpaAsOnGpu",
    "backward",
    "fake_world",
    "finding",
    "flop_counter",
    "sdpa_choice",
    "unavailable",
]
