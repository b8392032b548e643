"""Megatron-Core GPT layer specs with ``core_attention`` swapped for :class:`UlyssesAttention`.

The swap happens in the ``ModuleSpec`` tree, never by monkeypatching ``SelfAttention``:
every other submodule of the base spec (qk-layernorm, GQA through ``num_query_groups``,
MoE MLPs, the norms) is kept as it is, and Megatron's own ``GPTModel`` /
``TransformerLayer`` build the model.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional, Union

from megatron.core.transformer.spec_utils import ModuleSpec

from .module import UlyssesAttention


def swap_core_attention(spec, *, backend: Union[str, object] = "sdpa", ulysses_group=None):
    """``spec`` with every self-attention ``core_attention`` made Ulysses.

    Works on a layer spec, a ``TransformerBlockSubmodules`` (``layer_specs`` list) or any
    nesting of ``ModuleSpec`` s, dataclasses, lists and ``functools.partial`` s (megatron-core
    0.19 builds MLP specs as partials).  Copies only the nodes on the way to a swapped
    ``core_attention``: everything else is the very object of ``spec`` (the input is never
    modified).  Raises if nothing was swapped."""
    params = {"backend": backend}
    if ulysses_group is not None:
        params["ulysses_group"] = ulysses_group
    count = [0]

    def visit(node):
        if isinstance(node, ModuleSpec):
            sub = visit(node.submodules)
            return node if sub is node.submodules else _replaced(node, submodules=sub)
        if isinstance(node, functools.partial):
            args = [visit(a) for a in node.args]
            keywords = {k: visit(v) for k, v in node.keywords.items()}
            if all(a is b for a, b in zip(args, node.args)) and all(keywords[k] is v for k, v in node.keywords.items()):
                return node
            return functools.partial(node.func, *args, **keywords)
        if isinstance(node, (list, tuple)):
            items = [visit(n) for n in node]
            return node if all(a is b for a, b in zip(items, node)) else type(node)(items)
        if isinstance(node, type) or not hasattr(node, "__dataclass_fields__"):
            return node
        changes = {}
        if hasattr(node, "core_attention") and hasattr(node, "linear_qkv"):
            changes["core_attention"] = ModuleSpec(module=UlyssesAttention, params=dict(params))
            count[0] += 1
        for name in node.__dataclass_fields__:
            if name not in changes:
                child = getattr(node, name)
                new = visit(child)
                if new is not child:
                    changes[name] = new
        return _replaced(node, **changes) if changes else node

    out = visit(spec)
    if not count[0]:
        raise ValueError("swap_core_attention: the spec has no self-attention core_attention to swap")
    return out


def _replaced(node, **changes):
    """A shallow copy of ``node`` with some attributes changed."""
    new = copy.copy(node)
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def get_ulysses_layer_spec(
    base: str = "local",
    *,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    backend: Optional[str] = None,
    **kwargs,
):
    """A GPT layer spec from Megatron-Core with Ulysses core attention.

    ``base="local"``: ``get_gpt_layer_local_spec`` (plain torch, runs on CPU), inner kernel
    ``backend`` (default ``"sdpa"``).  ``base="te"``:
    ``get_gpt_layer_with_transformer_engine_spec`` with the inner kernel TE's
    ``DotProductAttention`` (its own context parallelism off), ``backend`` default ``"te"``.
    Extra keywords go to the Megatron spec function."""
    from megatron.core.models.gpt import gpt_layer_specs as g

    if base == "local":
        spec = g.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm, **kwargs
        )
        backend = backend or "sdpa"
    elif base == "te":
        spec = g.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm, **kwargs
        )
        backend = backend or "te"
    else:
        raise ValueError(f"base={base!r}: use 'local' (plain torch, CPU) or 'te' (Transformer Engine)")
    return swap_core_attention(spec, backend=backend)
