"""ulysses_mcore.megatron.layer.offload: the checkpoints a recomputed forward saves go to host memory
and come back for the backward, one ahead (from the region's prefetch point), values unchanged; the
recompute's output is not held through its backward.  Megatron's full recompute with the
trainer (ulysses 2 against dp 2): tests/test_memory_features.py."""

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from ulysses_mcore.megatron.layer.offload import (
    HostOffload,
    ShapeOnly,
    _roots_only,
    enable_activation_offload,
    prefetch_point,
    release_recomputed_outputs,
)


class Blocks(torch.nn.Module):
    """Four layers, each recomputed in the backward (its input is what the forward saves); ``point``:
    each layer's input passes a prefetch point (as the attention's query does in a GPT layer)."""

    def __init__(self, width=32, n=4, point=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))
        self.point = prefetch_point if point else (lambda t: t)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(lambda t, f=layer: torch.nn.functional.gelu(f(self.point(t))), x, use_reentrant=True)
        return x


def _grads(model, x):
    x = x.clone().requires_grad_()
    model(x).square().sum().backward()
    out = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def test_offloaded_checkpoints_give_the_same_gradients_and_return_every_byte():
    model, x = Blocks(), torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _grads(model, x)
    stats = enable_activation_offload(model, min_bytes=1, copy_host=True)
    got = _grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert stats["tensors"] == 4  # one input per recomputed layer
    assert stats["peak_host_bytes"] == 4 * 64 * 32 * 8  # all four held at the end of the forward
    assert stats["host_bytes"] == 0  # every one came back
    assert enable_activation_offload(model) is stats  # once per model


def test_chunks_sharing_one_record_count_one_host_peak():
    """Two model chunks of a pipeline stage (the interleaved schedule) counted in one record: both
    chunks' forwards held before either backward peak at the sum, and everything comes back."""
    first, second = Blocks(), Blocks(n=2)
    x = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    stats = enable_activation_offload(first, min_bytes=1, copy_host=True)
    assert enable_activation_offload(second, min_bytes=1, copy_host=True, stats=stats) is stats
    y = second(first(x.requires_grad_()))  # the schedule's order: chunk 0, then chunk 1, then the backwards
    y.square().sum().backward()
    assert stats["tensors"] == 4 + 2 and stats["host_bytes"] == 0
    assert stats["peak_host_bytes"] == (4 + 2) * 64 * 32 * 8


class Recording(HostOffload):
    """Records each copy back (by host buffer), how many copies had started at each unpack, and how
    many after it (an unpack starts none: the region's prefetch point does)."""

    def __init__(self):
        self.fetched, self.at_unpack, self.after_unpack = [], [], []
        super().__init__(1, copy_host=True)

    def _fetch(self, saved):
        self.fetched.append(saved.host.data_ptr())
        super()._fetch(saved)

    def _unpack(self, saved):
        self.at_unpack.append(len(self.fetched))
        out = super()._unpack(saved)
        self.after_unpack.append(len(self.fetched))
        return out


def _backward_of(model):
    x = torch.randn(16, 32, dtype=torch.float64).requires_grad_()
    hooks = Recording()
    with hooks:
        out = model(x)
    saved, node = [], hooks.last
    while node is not None:
        saved.append(node.host.data_ptr())
        node = node.previous
    out.sum().backward()
    return hooks, saved


def test_the_backward_prefetches_the_layer_below_from_the_prefetch_point():
    """Layer i's prefetch point (in its backward) starts the copy of layer i-1's input: copies back in
    reverse order; every unpack after the first finds its tensor's copy started, and starts none."""
    hooks, saved = _backward_of(Blocks())
    assert len(saved) == 4 and hooks.fetched == saved  # the last layer's input first, then each one below it
    assert hooks.at_unpack == [0, 2, 3, 4]  # layer 4 fetched on demand; 3, 2, 1 were already on their way
    assert hooks.after_unpack == [1, 2, 3, 4]  # the unpack fetched only what was not on its way


def test_a_region_without_a_prefetch_point_fetches_on_demand():
    hooks, saved = _backward_of(Blocks(point=False))
    assert hooks.fetched == saved and hooks.at_unpack == [0, 1, 2, 3]


def test_small_and_cpu_tensors_stay_where_they_are_without_copy_host():
    hooks = HostOffload(1 << 20)
    small = torch.ones(4, requires_grad=True)
    big = torch.ones(1 << 19)  # 2 MB on the CPU: already host memory
    assert hooks._pack(small) is small and hooks._pack(big) is big
    assert hooks.stats["tensors"] == 0


class Head(torch.nn.Module):
    """A matmul against a weight as large as its input: the backward saves both (as a loss's output
    layer does); the model holds the weight, so copying it frees nothing."""

    def __init__(self, width=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, width, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(x) @ self.weight.t()


def test_a_parameter_saved_for_the_backward_stays_on_the_device():
    model, x = Head(), torch.randn(64, 32, dtype=torch.float64)
    want = _grads(model, x)
    stats = enable_activation_offload(model, min_bytes=1, copy_host=True)
    got = _grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # tanh's output (the matmul's input) and tanh's own saved output: two activations, the weight not
    assert stats["tensors"] == 2 and stats["peak_host_bytes"] == 2 * 64 * 32 * 8


class _Probe(torch.autograd.Function):
    """Identity; its backward records which of the region's outputs (by weak reference) are alive."""

    alive: list = []
    refs: list = []

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        _Probe.alive.append([r() is not None for r in _Probe.refs])
        return grad


def _region(x):
    y = _Probe.apply(x * 2.0) + 1.0  # a residual add's output: nothing saves it
    _Probe.refs.append(weakref.ref(y))
    return y


def _checkpointed_grad(run_function):
    from megatron.core.tensor_parallel.random import CheckpointFunction

    _Probe.alive, _Probe.refs = [], []
    x = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(8, 4).requires_grad_()
    y = CheckpointFunction.apply(run_function, False, x)
    (y * y).sum().backward()
    return x.grad, _Probe.alive


def test_the_recompute_hands_megatrons_checkpoint_its_outputs_shape_not_its_bytes():
    """Megatron's CheckpointFunction holds the recomputed output through the region's backward; through
    _roots_only it holds a ShapeOnly root and the output is gone when the region's backward runs --
    with the same gradient."""
    from ulysses_mcore.megatron.compat import cpu_compat

    cpu_compat.apply()
    want, alive = _checkpointed_grad(_region)
    assert alive == [[True, True]]  # the forward's output (the caller's y) and the recompute's
    got, alive = _checkpointed_grad(_roots_only(_region))
    assert alive == [[True, False]]  # the recompute's output freed before its backward
    assert torch.equal(got, want)


def test_release_recomputed_outputs_routes_megatrons_checkpoint_once():
    from megatron.core import tensor_parallel

    release_recomputed_outputs()
    wrapped = tensor_parallel.checkpoint
    release_recomputed_outputs()
    assert tensor_parallel.checkpoint is wrapped and wrapped._roots_only


def test_shape_only_keeps_shape_dtype_device_and_passes_the_gradient():
    t = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    root = ShapeOnly.apply(t * 1.0)
    assert root.shape == t.shape and root.dtype == t.dtype and root.untyped_storage().nbytes() == 8
    g = torch.randn(3, 5, dtype=torch.float64)
    root.backward(g)
    assert torch.equal(t.grad, g)
