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

from megatron.core.models.gpt import gpt_layer_specs as g
from megatron.core.transformer import multi_latent_attention as mla
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from ulysses_mcore.megatron.layer.memory import tiled_mlp_class
from ulysses_mcore.megatron.layer.module import UlyssesAttention


def _same(new, old) -> bool:
    return all(a is b for a, b in zip(new, old))


def _walk_spec(node, visit):
    sub = visit(node.submodules)
    return node if sub is node.submodules else _replaced(node, submodules=sub)


def _walk_partial(node, visit):
    args = [visit(a) for a in node.args]
    keywords = {k: visit(v) for k, v in node.keywords.items()}
    if _same(args, node.args) and _same(keywords.values(), node.keywords.values()):
        return node
    return functools.partial(node.func, *args, **keywords)


def _walk_sequence(node, visit):
    items = [visit(n) for n in node]
    return node if _same(items, node) else type(node)(items)


def _walk_dataclass(node, visit):
    changes = {}
    for name in node.__dataclass_fields__:
        child = getattr(node, name)
        new = visit(child)
        if new is not child:
            changes[name] = new
    return _replaced(node, **changes) if changes else node


_WALKS = (  # (is this the kind of node, how to rebuild it from its visited children), first match wins
    (lambda n: isinstance(n, ModuleSpec), _walk_spec),
    (lambda n: isinstance(n, functools.partial), _walk_partial),
    (lambda n: isinstance(n, (list, tuple)), _walk_sequence),
    (lambda n: not isinstance(n, type) and hasattr(n, "__dataclass_fields__"), _walk_dataclass),
)


def _rewrite(spec, replace):
    """``spec`` with every node for which ``replace(node)`` is not None replaced by it.

    Walks ``ModuleSpec`` s, dataclasses (layer / block submodules), lists and
    ``functools.partial`` s (megatron-core 0.19 builds MLP specs as partials).  Copies only
    the nodes on the way to a replaced one: everything else is the very object of ``spec``
    (the input is never modified)."""

    def visit(node):
        new = replace(node)
        if new is not None:
            return new
        for kind, walk in _WALKS:
            if kind(node):
                return walk(node, visit)
        return node

    return visit(spec)


def swap_core_attention(spec, *, backend: Union[str, object] = "sdpa", ulysses_group=None, dynamic=None):
    """``spec`` with every self-attention ``core_attention`` made Ulysses (a layer spec, a
    ``TransformerBlockSubmodules`` or any nesting; see :func:`_rewrite`).  ``dynamic``: the
    :class:`~ulysses_mcore.megatron.layer.rotary.DynamicOptions` of ``--dynamic-ulysses``.  Raises if
    nothing was swapped."""
    params = {"backend": backend}
    if dynamic is not None:
        params["dynamic"] = dynamic
    if ulysses_group is not None:
        params["ulysses_group"] = ulysses_group
    count = [0]

    def replace(node):
        if (
            not isinstance(node, (type, ModuleSpec, functools.partial, list, tuple))
            and hasattr(node, "__dataclass_fields__")
            and hasattr(node, "core_attention")
            and (hasattr(node, "linear_qkv") or hasattr(node, "linear_kv_down_proj"))
        ):  # self-attention, MLA too
            count[0] += 1
            if hasattr(node, "linear_kv_down_proj"):
                _mla_without_transformer_engine()
            return _replaced(node, core_attention=ModuleSpec(module=UlyssesAttention, params=dict(params)))
        return None

    out = _rewrite(spec, replace)
    if not count[0]:
        raise ValueError("swap_core_attention: the spec has no self-attention core_attention to swap")
    return out


def swap_mlp(spec, *, chunk_tokens: int):
    """``spec`` with every dense Megatron ``MLP`` (a ``ModuleSpec(module=MLP)`` or 0.19's
    ``partial(MLP.as_mlp_submodule, ...)``) made sequence-tiled
    (:func:`ulysses_mcore.megatron.layer.memory.tiled_mlp_class`).  MoE experts are left alone.
    Raises if there is no dense MLP."""
    tiled = tiled_mlp_class(int(chunk_tokens))
    count = [0]

    def replace(node):
        if isinstance(node, ModuleSpec) and node.module is MLP:
            count[0] += 1
            return _replaced(node, module=tiled)
        if isinstance(node, functools.partial) and getattr(node.func, "__self__", None) is MLP:
            count[0] += 1
            return functools.partial(getattr(tiled, node.func.__name__), *node.args, **node.keywords)
        return None

    out = _rewrite(spec, replace)
    if not count[0]:
        raise ValueError("--mlp-chunk-tokens: the layer spec has no dense Megatron MLP to tile")
    return out


def _replaced(node, **changes):
    """A shallow copy of ``node`` with some attributes changed."""
    new = copy.copy(node)
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def _mla_without_transformer_engine() -> None:
    """megatron-core's ``MLASelfAttention`` checks ``isinstance(linear_proj, TELinear)`` under its
    module's ``HAVE_TE``, which its import sets True even where Transformer Engine is absent
    (``TELinear`` is then None and the check raises ``TypeError``).  Without TE there is no
    ``TELinear`` to find: tell that module so.  Nothing changes where TE is installed."""
    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False


def get_ulysses_layer_spec(
    base: str = "local",
    *,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    backend: Optional[str] = None,
    mlp_chunk_tokens: Optional[int] = None,
    dynamic=None,
    **kwargs,
):
    """A GPT layer spec from Megatron-Core with Ulysses core attention.

    ``base="local"``: ``get_gpt_layer_local_spec`` (plain torch, runs on CPU), inner kernel
    ``backend`` (default ``"sdpa"``).  ``base="te"``:
    ``get_gpt_layer_with_transformer_engine_spec`` with the inner kernel TE's
    ``DotProductAttention`` (its own context parallelism off), ``backend`` default ``"te"``.
    ``mlp_chunk_tokens``: the MLP sequence-tiled (:func:`swap_mlp`).  ``dynamic``: a degree per
    micro-batch (``--dynamic-ulysses``, :class:`~ulysses_mcore.megatron.layer.rotary.DynamicOptions`).
    Extra keywords go to the Megatron spec function."""
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
    spec = swap_core_attention(spec, backend=backend, dynamic=dynamic)
    return swap_mlp(spec, chunk_tokens=mlp_chunk_tokens) if mlp_chunk_tokens else spec
