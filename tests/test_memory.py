"""Chunked linear cross-entropy and the sequence-tiled MLP (ulysses_mcore.megatron.layer.memory).

References: float64 cross-entropy over the whole logits (written out here), and Megatron's own
MLP / GPTModel loss without chunking.  GPTModel-level parity with both features at ulysses 2,
tp 2 x ulysses 2 and pp 2 x ulysses 2 against the unsharded model is in tests/test_training.py.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import run_threaded

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="an in-process CPU world (Megatron's CUDA calls "
    "mapped to the CPU by cpu_compat); on GPU nodes the parity world covers it",
)


def _reference(hidden, weight, labels):
    """Per-token cross-entropy in float64 over the full vocabulary."""
    logits = hidden.double() @ weight.double().t()
    return torch.logsumexp(logits, -1) - logits.gather(1, labels[:, None]).squeeze(1)


@pytest.mark.parametrize("tp,chunk", [(1, 7), (1, 64), (2, 5), (4, 3)])
def test_chunked_cross_entropy_matches_float64_vocab_parallel(tp, chunk):
    """Loss, hidden gradient (summed over the vocabulary shards, as the tp mapping does) and each
    rank's weight-shard gradient, against float64 over the whole vocabulary; a per-token upstream
    gradient that is not a constant (Megatron scales by the loss mask)."""
    from ulysses_mcore.megatron.layer.memory import ChunkedLinearCrossEntropy

    g = torch.Generator().manual_seed(0)
    T, h, V = 23, 16, 48
    hidden = torch.randn(T, h, generator=g)
    weight = torch.randn(V, h, generator=g) * 0.5
    labels = torch.randint(0, V, (T,), generator=g)
    upstream = torch.rand(T, generator=g) * (torch.rand(T, generator=g) > 0.3)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference(hr, wr, labels)
    (ref * upstream.double()).sum().backward()

    def rank_fn(rank, world):
        Vl = V // world
        hd = hidden.clone().requires_grad_()
        wd = weight[rank * Vl : (rank + 1) * Vl].clone().requires_grad_()
        loss = ChunkedLinearCrossEntropy.apply(hd, wd, labels, chunk, (dist.group.WORLD, rank * Vl))
        (loss * upstream).sum().backward()
        return loss.detach(), hd.grad, wd.grad

    out = run_threaded(tp, rank_fn)
    for loss, _, _ in out:
        assert (loss.double() - ref).abs().max() / ref.abs().max() < 1e-6
    grad_h = sum(o[1] for o in out).double()
    assert (grad_h - hr.grad).abs().max() / hr.grad.abs().max() < 1e-5
    grad_w = torch.cat([o[2] for o in out]).double()
    assert (grad_w - wr.grad).abs().max() / wr.grad.abs().max() < 1e-5


def test_chunked_cross_entropy_negative_control():
    """The same check catches a wrong vocabulary offset (each rank believing it holds rows 0..V/tp)."""
    from ulysses_mcore.megatron.layer.memory import ChunkedLinearCrossEntropy

    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(16, 8, generator=g)
    labels = torch.randint(0, 16, (9,), generator=g)
    ref = _reference(hidden, weight, labels)

    def rank_fn(rank, world):
        return ChunkedLinearCrossEntropy.apply(
            hidden, weight[rank * 8 : (rank + 1) * 8], labels, 4, (dist.group.WORLD, 0)
        )

    loss = run_threaded(2, rank_fn)[0]
    assert (loss.double() - ref).abs().max() > 1e-2


def test_chunked_cross_entropy_bf16_accumulates_in_fp32():
    from ulysses_mcore.megatron.layer.memory import ChunkedLinearCrossEntropy

    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(40, 32, generator=g), torch.randn(300, 32, generator=g) * 0.2
    labels = torch.randint(0, 300, (40,), generator=g)
    hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    loss = ChunkedLinearCrossEntropy.apply(hb, wb, labels, 16, (None, 0))
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    ref = _reference(hb.detach().float(), wb.detach().float(), labels)  # the bf16 values, in float64
    assert (loss.double() - ref).abs().max() / ref.abs().max() < 1e-2


class _WholeSequence(TorchDispatchMode):
    """The ops that make a new tensor of the input's whole shape (``made``: their names)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.made = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape and out._base is None:
            if not any(isinstance(a, torch.Tensor) and a.data_ptr() == out.data_ptr() for a in args):
                self.made.append(func.overloadpacket.__name__)
        return out


@CPU_ONLY
@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_tiled_mlp_equals_megatrons_mlp(gated):
    """Megatron's MLP vs the tiled one with the same weights (tp 1, one process): outputs and
    every gradient; the forward keeps no [tokens, ffn] intermediate (saved tensors counted)."""
    world = _single_rank_megatron()
    try:
        import functools

        from megatron.core.transformer.spec_utils import build_module

        from ulysses_mcore.megatron.trainer import training
        from ulysses_mcore.megatron.layer.specs import get_ulysses_layer_spec, swap_mlp

        cfg = training.gpt_config(
            num_layers=1,
            hidden_size=16,
            ffn_hidden_size=64,
            num_attention_heads=2,
            gated_linear_unit=gated,
            activation_func=torch.nn.functional.silu if gated else torch.nn.functional.gelu,
            add_bias_linear=True,
        )

        def build(spec):  # megatron-core 0.16: a ModuleSpec; 0.19: partial(MLP.as_mlp_submodule, ...)
            if isinstance(spec, functools.partial):
                from megatron.core.process_groups_config import ProcessGroupCollection

                return spec(
                    config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False
                )
            return build_module(spec, config=cfg)

        spec = get_ulysses_layer_spec().submodules.mlp
        torch.manual_seed(0)
        plain = build(spec)
        tiled = build(swap_mlp(spec, chunk_tokens=6))
        assert type(tiled).__name__ == "TiledMLP6" and type(plain).__name__ == "MLP"
        tiled.load_state_dict(plain.state_dict())
        x = torch.randn(13, 2, 16)
        outs, made = {}, {}
        for name, m in (("plain", plain), ("tiled", tiled)):
            xi = x.clone().requires_grad_()
            saved = []

            def pack(t):  # the activations saved (the weights are the model's anyway)
                return t if isinstance(t, torch.nn.Parameter) else saved.append(t.shape) or t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                o, bias = m(xi)
            o = o + (bias if bias is not None else 0)
            with _WholeSequence(x.shape) as whole:
                (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
            outs[name] = (o.detach(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()}, saved)
            made[name] = whole.made
        (o1, gx1, gp1, saved1), (o2, gx2, gp2, saved2) = outs["plain"], outs["tiled"]
        # the backward makes the input's gradient once, written chunk by chunk; slicing under autograd
        # made a whole-sequence gradient for each of the 3 chunks (slice_backward) and summed them (add)
        extra = list(made["tiled"])
        for op in made["plain"]:  # the upstream gradient's own (the same in both)
            extra.remove(op)
        assert extra == ["empty_like"], made
        assert (o1 - o2).abs().max() < 1e-6 and (gx1 - gx2).abs().max() < 1e-6
        for n in gp1:
            assert (gp1[n] - gp2[n]).abs().max() <= 1e-6 * gp1[n].abs().max().clamp_min(1), n

        def widest(saved):  # the largest saved tensor at least ffn wide (elements)
            return max((s.numel() for s in saved if s[-1] >= 64), default=0)

        assert widest(saved1) >= 13 * 2 * 64  # Megatron's MLP keeps the whole [s, b, ffn] intermediate
        assert widest(saved2) <= 3 * 2 * 128  # tiled: at most one chunk's (6 tokens = 3 rows of b 2) at a time
    finally:
        world()


@CPU_ONLY
@pytest.mark.parametrize("tp,chunk", [(2, 5), (4, 2)])
def test_chunked_loss_under_sequence_parallelism(tp, chunk):
    """The sequence-parallel input: each rank holds s/tp positions; Megatron's all-gather feeds the
    chunks and its reduce-scatter returns each rank's hidden gradient.  Against float64 over the
    whole sequence and vocabulary: every rank's loss [b, s], its hidden shard's and weight shard's
    gradients."""
    from ulysses_mcore.megatron.compat import cpu_compat
    from ulysses_mcore.megatron.layer.memory import chunked_cross_entropy

    g = torch.Generator().manual_seed(3)
    s, b, h, V = 12, 2, 8, 24
    hidden, weight = torch.randn(s, b, h, generator=g), torch.randn(V, h, generator=g)
    labels, upstream = torch.randint(0, V, (b, s), generator=g), torch.rand(b, s, generator=g)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = torch.einsum("sbh,vh->bsv", hr, wr)
    ref = torch.logsumexp(logits, -1) - logits.gather(2, labels[..., None]).squeeze(-1)
    (ref * upstream.double()).sum().backward()

    def rank_fn(rank, world):
        Vl, sl = V // world, s // world
        hd = hidden[rank * sl : (rank + 1) * sl].clone().requires_grad_()
        wd = weight[rank * Vl : (rank + 1) * Vl].clone().requires_grad_()
        loss = chunked_cross_entropy(
            hd, wd, labels, chunk, tp_group=dist.group.WORLD, vocab_start=rank * Vl, sequence_parallel=True
        )
        (loss * upstream).sum().backward()
        return loss.detach(), hd.grad, wd.grad

    cpu_compat.apply()  # Megatron's gather allocates on torch.cuda.current_device()
    try:
        out = run_threaded(tp, rank_fn)
    finally:
        cpu_compat.remove()
    for loss, _, _ in out:
        assert (loss.double() - ref).abs().max() / ref.abs().max() < 1e-6
    grad_h = torch.cat([o[1] for o in out]).double()
    assert (grad_h - hr.grad).abs().max() / hr.grad.abs().max() < 1e-5
    grad_w = torch.cat([o[2] for o in out]).double()
    assert (grad_w - wr.grad).abs().max() / wr.grad.abs().max() < 1e-5


def _single_rank_megatron():
    """A gloo world of one with Megatron's parallel state: returns its teardown."""
    import os

    from tests.helpers import free_port
    from ulysses_mcore.megatron.compat import cpu_compat

    cpu_compat.apply()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import ulysses_mcore
    from ulysses_mcore.megatron.layer import groups

    ulysses_mcore.initialize(verbose=False)

    def teardown():
        groups.destroy()
        dist.destroy_process_group()
        cpu_compat.remove()

    return teardown
