"""ulysses_mcore.megatron.layer.offload: the checkpoints a recomputed forward saves go to host memory
and come back for the backward, one ahead, values unchanged.  Megatron's full recompute with the
trainer (ulysses 2 against dp 2): tests/test_memory_features.py."""

import torch
from torch.utils.checkpoint import checkpoint

from ulysses_mcore.megatron.layer.offload import HostOffload, enable_activation_offload


class Blocks(torch.nn.Module):
    """Four layers, each recomputed in the backward (its input is what the forward saves)."""

    def __init__(self, width=32, n=4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(lambda t, f=layer: torch.nn.functional.gelu(f(t)), x, use_reentrant=True)
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
    """Records each copy back (by host buffer) and, at each unpack, how many copies had started."""

    def __init__(self):
        self.fetched, self.at_unpack = [], []
        super().__init__(1, copy_host=True)

    def _fetch(self, saved):
        self.fetched.append(saved.host.data_ptr())
        super()._fetch(saved)

    def _unpack(self, saved):
        self.at_unpack.append(len(self.fetched))
        return super()._unpack(saved)


def test_the_backward_prefetches_the_layer_below_while_one_is_in_use():
    """Unpacking layer i's input starts the copy of layer i-1's: copies back in reverse order, and at
    every unpack after the first the tensor's copy had already started."""
    model, x = Blocks(), torch.randn(16, 32, dtype=torch.float64).requires_grad_()
    hooks = Recording()
    with hooks:
        out = model(x)
    saved, node = [], hooks.last
    while node is not None:
        saved.append(node.host.data_ptr())
        node = node.previous
    out.sum().backward()
    assert len(saved) == 4 and hooks.fetched == saved  # the last layer's input first, then each one below it
    assert hooks.at_unpack == [0, 2, 3, 4]  # layer 4 fetched on demand; 3, 2, 1 were already on their way


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
