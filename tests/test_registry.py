"""The kernel registry: a backend name or a callable to the kernel that runs, and what a callable
is told (the global heads, the variant options it declares) or refused (masks, bias, dropout, a
variant it does not declare), before it runs."""

import pytest
import torch

from ulysses_mcore.kernels import registry, sdpa
from tests.helpers import reference_attention


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(12, 1, 2, 8, generator=g) for _ in range(3)]


def test_sdpa_resolves_to_its_kernel_and_unknown_names_are_refused():
    assert registry.resolve("sdpa") is sdpa.sdpa_attention
    with pytest.raises(ValueError, match=r"backend='nope' is unknown: use one of \['sdpa', 'flash', 'te'\]"):
        registry.resolve("nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a process without a GPU")
@pytest.mark.parametrize("name, pkg", [("flash", "flash-attn"), ("te", "transformer-engine")])
def test_gpu_kernels_without_a_gpu_say_what_to_install(name, pkg):
    with pytest.raises(ValueError, match=rf"backend='{name}' needs {pkg} and a CUDA GPU"):
        registry.resolve(name)


def test_a_callable_runs_with_the_heads_and_variants_it_declares():
    """A kernel declaring ``heads`` and ``window_size`` gets both; its result is returned as is."""
    q, k, v = _qkv()
    seen = {}

    def kernel(q, k, v, *, causal, softmax_scale, heads, window_size):
        seen.update(heads=heads, window_size=window_size)
        return sdpa.sdpa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)

    out = registry.resolve(kernel)(q, k, v, causal=True, softmax_scale=0.5, heads=(2, 4), window_size=(3, 0))
    assert seen == {"heads": (2, 4), "window_size": (3, 0)}
    ref = reference_attention(q, k, v, causal=True, softmax_scale=0.5, window_size=(3, 0))
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_callable_is_refused_what_it_cannot_take():
    q, k, v = _qkv()
    run = registry.resolve(lambda q, k, v, *, causal, softmax_scale: q)
    with pytest.raises(ValueError, match="masks, bias and dropout need backend='sdpa' or 'te'"):
        run(q, k, v, causal=True, attention_mask=torch.zeros(1, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="masks, bias and dropout"):
        run(q, k, v, causal=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="softmax_offset is set but the callable backend does not take"):
        run(q, k, v, causal=True, softmax_offset=torch.zeros(2))
    assert run(q, k, v, causal=True, heads=(0, 2)) is q  # heads are information: not declared, not passed
