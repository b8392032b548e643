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

Three things of a real GPU cannot be had without one, and are modelled here, by name:

* torch's SDPA picks its kernel from the device's properties, so without a GPU it falls back to
  the unfused math path.  :class:`SdpaAsOnGpu` stands in for the choice torch makes on a
  Hopper GPU (flash for fp16 / bf16 without a mask, head dims up to 256 in multiples of 8;
  memory-efficient with a mask or fp32; else math) and calls that fused kernel directly;
* the autograd engine refuses a backward on fake CUDA without a device, so :func:`backward` walks
  the graph itself and calls each node's backward (the backward kernels run on the forward's saved
  tensors, as on a GPU);
* torch's fake group carries tensors, not Python objects: ``all_gather_object`` answers every rank
  with this rank's object (the dry run's ranks of one kind build the same model).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import traceback
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import GraphExecGroup
from torch.utils.weak import WeakIdKeyDictionary

from ..options import flash_takes_head_dim

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
    gather_object, dist.all_gather_object = dist.all_gather_object, _own_object_everywhere
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        dist.all_gather_object = gather_object
        dist.destroy_process_group()


def _own_object_everywhere(out: list, obj, group=None) -> None:
    """``all_gather_object`` in a fake world (torch's fake group carries no objects): every rank's
    answer is this rank's object -- what the dry run's callers gather (Megatron's optimizer: the
    parameter-group keys) is the same on every rank of one model."""
    out[:] = [obj] * len(out)


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


def _flash_sdpa(q, k, v, p):
    """SDPA's flash kernel with ``p``: SDPA's keywords (dropout_p, is_causal, scale)."""
    return aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p=p["dropout_p"], is_causal=p["is_causal"], return_debug_mask=False, scale=p["scale"]
    )[0]


def _efficient_sdpa(q, k, v, p):
    """SDPA's memory-efficient kernel with ``p``: SDPA's keywords (attn_mask, dropout_p, is_causal, scale)."""
    bias = p["attn_mask"]
    if bias is not None and bias.dtype == torch.bool:  # SDPA's boolean mask: True = attend
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, compute_log_sumexp=True, dropout_p=p["dropout_p"], is_causal=p["is_causal"], scale=p["scale"]
    )[0]


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
        choice = sdpa_choice(q, k, v, p["attn_mask"], dropout_p=p["dropout_p"], enable_gqa=p["enable_gqa"])
        self.choices[choice] += 1
        if choice == "flash":
            return _flash_sdpa(q, k, v, p)
        if choice == "efficient":
            return _efficient_sdpa(q, k, v, p)
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
def _attention_flops(b, h, lengths, dims, causal: bool) -> int:
    """QK^T and PV of one attention of ``lengths = (queries, keys)`` and head ``dims = (d, dv)``,
    multiply-adds counted twice; causal computes about half."""
    (sq, sk), (d, dv) = lengths, dims
    full = 2 * b * h * sq * sk * (d + dv)
    return full // 2 if causal and sq == sk else full


def _sdpa_flops(q_shape, k_shape, v_shape, causal):
    b, h, sq, d = q_shape
    return _attention_flops(b, h, (sq, k_shape[2]), (d, v_shape[-1]), causal)


def _varlen_flops(q, max_q, causal, v_dim, docs: Optional[List[int]]):
    """Packed documents: each document attends to itself (the boundaries' values are unknown on
    fake tensors, so ``docs`` -- the document lengths the caller packed -- count; else the longest
    document stands for all, an upper bound)."""
    t, h, d = q
    lens = docs if docs else [max_q] * max(1, t // max(1, max_q))
    return sum(_attention_flops(1, h, (n, n), (d, v_dim), causal) for n in lens)


def flop_mapping(docs: Optional[List[int]] = None) -> dict:
    """``FlopCounterMode(custom_mapping=...)`` for the attention kernels (CUDA's and the CPU's): causal
    counted as half, packed documents each on their own (``docs``: the packed document lengths, when known)."""

    def flash_sdpa(q, k, v, dropout_p=0.0, is_causal=False, *a, out_shape=None, **kw):
        return _sdpa_flops(q, k, v, is_causal)

    def eff_sdpa(q, k, v, bias=None, lse=False, dropout_p=0.0, is_causal=False, *a, out_shape=None, **kw):
        return _sdpa_flops(q, k, v, is_causal)

    def flash_bwd(grad, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, *a, out_shape=None, **kw):
        return 2 * _sdpa_flops(q, k, v, is_causal)

    def eff_bwd(grad, q, k, v, bias, out, lse, dropout_p, grad_bias, is_causal=False, *a, out_shape=None, **kw):
        return 2 * _sdpa_flops(q, k, v, is_causal)

    def cpu_bwd(grad, q, k, v, out, lse, dropout_p, is_causal, *a, out_shape=None, **kw):
        return 2 * _sdpa_flops(q, k, v, is_causal)

    def varlen_fwd(q, k, v, cq, ck, mq, mk, dropout_p, is_causal, *a, out_shape=None, **kw):
        return _varlen_flops(q, mq, is_causal or kw.get("window_size_right") == 0, v[-1], docs)

    def varlen_bwd(grad, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, *a, out_shape=None, **kw):
        return 2 * _varlen_flops(q, mq, is_causal or kw.get("window_size_right") == 0, v[-1], docs)

    def torch_varlen(q, k, v, cq, ck, mq, mk, is_causal=False, *a, out_shape=None, **kw):
        return _varlen_flops(q, mq, is_causal, v[-1], docs)

    def torch_varlen_bwd(grad, q, k, v, out, lse, cq, ck, mq, mk, is_causal, *a, out_shape=None, **kw):
        return 2 * _varlen_flops(q, mq, is_causal, v[-1], docs)

    table = {}
    if _varlen_op("_varlen_attn") is not None:  # torch.nn.attention.varlen's custom ops
        table = {_varlen_op("_varlen_attn"): torch_varlen, _varlen_op("_varlen_attn_backward"): torch_varlen_bwd}
    return table | {
        aten._scaled_dot_product_flash_attention: flash_sdpa,
        aten._scaled_dot_product_efficient_attention: eff_sdpa,
        aten._scaled_dot_product_flash_attention_backward: flash_bwd,
        aten._scaled_dot_product_efficient_attention_backward: eff_bwd,
        aten._scaled_dot_product_flash_attention_for_cpu: flash_sdpa,  # the CPU's kernel: the same counts
        aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_bwd,
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
def backward(output: torch.Tensor, grad: torch.Tensor, *, keep=None) -> Dict[torch.Tensor, torch.Tensor]:
    """The backward of ``output`` without the autograd engine (which needs a device), in the engine's
    order: a node runs once every gradient it takes has arrived, the most recently created ready node
    first (the engine's ``sequence_nr`` priority), each called on the gradients of its outputs (custom
    ``autograd.Function`` nodes through their ``backward``); a gradient is freed once its node ran.
    Returns ``{leaf: gradient}`` for the leaves ``keep(leaf)`` accepts (default: all)."""
    # one group for the whole backward: a non-reentrant checkpoint recomputes its region once, as in the
    # engine (outside the engine it would take every unpack for a new backward and recompute again)
    group = contextlib.nullcontext() if GraphExecGroup._get_current_group() is not None else GraphExecGroup()
    with torch.no_grad(), group:  # as the engine runs a backward without create_graph
        return _run_backward(output, grad, keep or (lambda leaf: True))


def _run_backward(output, grad, keep):
    root = output.grad_fn
    waiting = _dependencies(root)
    grads: Dict[tuple, torch.Tensor] = {(root, 0): grad}
    leaves: Dict[torch.Tensor, torch.Tensor] = {}
    ready, tie = [(-root._sequence_nr(), 0, root)], itertools.count(1)
    while ready:
        node = heapq.heappop(ready)[2]
        n_out = len(getattr(node, "_input_metadata", ())) or 1
        ins = [grads.pop((node, i), None) for i in range(n_out)]
        outs = () if all(g is None for g in ins) else _call(node, ins)
        for k, (nxt, idx) in enumerate(node.next_functions):
            g = outs[k] if k < len(outs) else None
            if nxt is None:
                continue
            if _is_leaf(nxt):  # a leaf's gradient, by the leaf (its accumulator node is made afresh per access)
                _add(leaves, nxt.variable, g if keep(nxt.variable) else None)
                continue
            _add(grads, (nxt, idx), g)
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(ready, (-nxt._sequence_nr(), next(tie), nxt))
        del ins, outs
    return leaves


def _add(table: dict, key, g) -> None:
    if g is not None:
        table[key] = g if key not in table else table[key] + g


def _is_leaf(node) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def _call(node, ins) -> tuple:
    """The node's gradients, one per edge (``next_functions``): a custom ``autograd.Function`` returns
    one per forward input, non-tensors included, which the engine maps onto the tensor inputs' edges."""
    if callable(node):
        outs = node(*ins)
        return outs if isinstance(outs, tuple) else (outs,)
    outs = type(node)._forward_cls.backward(node, *ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    mask = _TENSOR_INPUTS.get(node)
    if mask is None or len(outs) == len(node.next_functions):
        return outs
    return tuple(g for g, is_tensor in zip(outs, mask) if is_tensor)


_TENSOR_INPUTS = WeakIdKeyDictionary()  # custom Function node -> which forward inputs were tensors


@contextlib.contextmanager
def recording_function_inputs():
    """Record, for each custom ``autograd.Function`` applied inside, which of its inputs were tensors
    (the engine keeps this in C++; :func:`backward` needs it to map gradients onto edges)."""
    apply = torch.autograd.Function.apply.__func__

    def recorded(cls, *args, **kwargs):
        out = apply(cls, *args, **kwargs)
        node = next((t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn), None)
        if node is not None and hasattr(type(node), "_forward_cls"):
            _TENSOR_INPUTS[node] = tuple(isinstance(a, torch.Tensor) for a in args)
        return out

    torch.autograd.Function.apply = classmethod(recorded)
    try:
        yield
    finally:
        torch.autograd.Function.apply = classmethod(apply)


def _dependencies(root) -> Dict[object, int]:
    """How many edges of the graph lead into each node (the engine's dependency count)."""
    count: Dict[object, int] = defaultdict(int)
    for node in _topological(root):
        for nxt, _ in node.next_functions:
            if nxt is not None and not _is_leaf(nxt):
                count[nxt] += 1
    return count


def _listed(x) -> list:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _leaf_gradients(tensors, grad_tensors, keep) -> dict:
    """``{leaf: gradient}`` of ``tensors`` (each with its gradient, ones if None) over the leaves ``keep`` takes."""
    tensors = _listed(tensors)
    grads = [None] * len(tensors) if grad_tensors is None else _listed(grad_tensors)
    got: Dict[torch.Tensor, torch.Tensor] = {}
    for t, g in zip(tensors, grads):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            for leaf, lg in backward(t, torch.ones_like(t) if g is None else g, keep=keep).items():
                _add(got, leaf, lg)
    return got


@contextlib.contextmanager
def engine_free_autograd():
    """``torch.autograd.backward`` -- which Megatron's recompute (``CheckpointFunction.backward``) calls
    inside the backward -- runs through :func:`backward`: the gradients of non-parameter leaves land in
    their ``.grad`` (what the recompute returns); parameters' are dropped, as Megatron's DDP moves each
    into its gradient buffer (the dry run models that buffer).  ``torch.autograd.grad`` (the tiled
    MLP's backward) returns the gradients of the inputs it names, parameters included."""
    engine, engine_grad = torch.autograd.backward, torch.autograd.grad

    def run(tensors, grad_tensors=None, *args, **kwargs):
        for leaf, lg in _leaf_gradients(tensors, grad_tensors, not_a_parameter).items():
            leaf.grad = lg if leaf.grad is None else leaf.grad + lg

    def grad(outputs, inputs, grad_outputs=None, *args, **kwargs):
        inputs = _listed(inputs)
        named = {id(t) for t in inputs}
        got = _leaf_gradients(outputs, grad_outputs, lambda leaf: id(leaf) in named)
        return tuple(got.get(t) for t in inputs)

    torch.autograd.backward, torch.autograd.grad = run, grad
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = engine, engine_grad


def not_a_parameter(leaf) -> bool:
    """A leaf whose gradient a dry run keeps: parameters' go to Megatron's (modelled) gradient buffer."""
    return not isinstance(leaf, torch.nn.Parameter)


@functools.cache
def _aliases(func) -> bool:
    """Whether ``func``'s results share an input's storage (its schema marks them)."""
    return any(r.alias_info is not None for r in func._schema.returns)


class LiveBytes(TorchDispatchMode):
    """Bytes of the CUDA storages made under this mode and still alive, and their peak (a storage
    counts once, views and in-place results included).  Unlike torch's ``MemTracker`` it takes a
    module that runs twice in a step (full recompute).  ``holders()``: what was live at the peak,
    the largest groups first (the op that made each storage, its shape and dtype)."""

    def __init__(self):
        super().__init__()
        self.live = WeakIdKeyDictionary()  # storage -> (bytes, label)
        self.now = self.peak = 0
        self._snapshot, self._snapshot_at = [], 0

    def _free(self, nbytes: int) -> None:
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _aliases(func):  # a view, in-place or out= result: no new storage (a parameter's view is no activation)
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                if st not in self.live:
                    n = st.nbytes()
                    label = f"{func.overloadpacket.__name__} {list(t.shape)} {t.dtype}".replace("torch.", "")
                    self.live[st] = (n, label)
                    weakref.finalize(st, self._free, n)
                    self.now += n
                    self.peak = max(self.peak, self.now)
                    if self.now > self._snapshot_at * 1.02:  # a new peak by 2%: who holds it
                        self._snapshot, self._snapshot_at = list(self.live.values()), self.now
        return out

    def holders(self, top: int = 4) -> List[str]:
        """The largest groups of storages live at the peak (within 2%): ``"12.3 GB: mm [s, b, h] bfloat16 x 3"``."""
        groups = defaultdict(lambda: [0, 0])
        for n, label in self._snapshot:
            groups[label][0] += n
            groups[label][1] += 1
        ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
        return [f"{n / 1e9:.1f} GB: {label} x {k}" for label, (n, k) in ranked]


class SavedOnce(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors handed to their node once and let go (the engine frees a node's saved tensors
    after it runs; the Python backward above cannot reach them): a forward under these hooks holds
    in its backward only what a real one does."""

    def __init__(self):
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def _pack(t):
        return [t]

    @staticmethod
    def _unpack(box):
        t = box[0]
        box[0] = None
        return t


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
    "/ulysses_mcore/devtools/fakeworld.py",
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
