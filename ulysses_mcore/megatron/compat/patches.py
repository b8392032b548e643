"""The Megatron-LM patches' logic (entry point: the ``megatron_patches`` package and its launcher).

Ulysses for users of Megatron-LM's own ``pretrain_gpt.py``, with no edit to Megatron-LM.

    torchrun --nproc-per-node 8 -m megatron_patches.launch /path/to/Megatron-LM/pretrain_gpt.py \
        --ulysses-degree 4 --tensor-model-parallel-size 2 ... (Megatron-LM's usual flags)

or, inside your own copy of the script (megatron-core <= 0.16; from 0.19 pass the provider
to ``parse_and_validate_args``)::

    import megatron_patches
    megatron_patches.apply()
    pretrain(..., extra_args_provider=megatron_patches.add_ulysses_args)

What :func:`apply` does (idempotent; :func:`remove` undoes it):

1. ``validate_args`` first folds ``--ulysses-degree U`` into Megatron's context-parallel
   axis: ``context_parallel_size = U * C`` (``C`` = ``--context-parallel-size``, the ring),
   with ``hierarchical_context_parallel_sizes = [U, C]`` when both are > 1.  Megatron-LM
   then does everything CP needs by itself: its ``get_batch`` slices tokens, labels,
   loss mask and positions in dual-chunk order, RoPE is sliced the same way, DDP reduces
   gradients over ``dp x cp`` and the loss is averaged over the right ranks.
2. ``parallel_state.initialize_model_parallel`` records the layout (for
   ``ulysses_mcore.megatron.layer.groups.get_topology``); :class:`ulysses_mcore.UlyssesAttention` takes
   its groups from the ``pg_collection`` Megatron hands it (the CP group, or its two
   hierarchical levels as ``hierarchical_context_parallel_sizes`` says).
3. The GPT layer-spec functions of megatron-core (local, Transformer Engine, decoder
   block) return their usual spec with ``core_attention`` swapped for
   ``UlyssesAttention`` (inner kernel TE when the spec is TE's, else SDPA) -- through
   ``ModuleSpec``, never by patching ``SelfAttention``.  megatron-core 0.19's own GPT
   builder (``megatron.training.models.gpt``) imports them by name and forces Megatron's
   ``DotProductAttention`` for the local attention backend: both names are rebound there.
   Only when ``--ulysses-degree`` > 1: without it the model is Megatron-LM's, untouched.
4. ``megatron.core.datasets.utils.compile_helpers`` skips ``make`` when the prebuilt
   helpers import (the megatron-core wheel ships them and no Makefile).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Dict, Tuple

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.spec_utils import ModuleSpec

from ulysses_mcore.megatron.layer.groups import remember
from ulysses_mcore.megatron.layer.memory import enable_chunked_loss
from ulysses_mcore.megatron.layer.offload import checkpoint_min_bytes, enable_activation_offload
from ulysses_mcore.megatron.layer.module import UlyssesAttention
from ulysses_mcore.megatron.layer.specs import swap_core_attention, swap_mlp
from ulysses_mcore.topology import Topology, TopologyError


class PatchState:
    """Everything the patches hold, in one place: the originals they replaced (to put back), the
    settings ``fold_args`` read from the flags, the shared local-attention spec of
    megatron.training's GPT builder, and which messages were printed.  :meth:`install` /
    :meth:`remove` are :func:`apply` / :func:`remove`."""

    def __init__(self):
        self.originals: Dict[Tuple[str, str], object] = {}
        self.settings: dict = {}
        self.local_spec: dict = {}  # the spec megatron.training's GPT builder uses for its local attention
        self.said: set = set()
        self.reset()

    def reset(self):
        self.settings.update(ulysses=1, cp=1, backend="auto", loss_chunk=None, mlp_chunk=None, offload=0)
        self.local_spec.clear()

    def install(self):
        for mod, name, wrap in _targets():
            key = (mod.__name__, name)
            fn = getattr(mod, name)
            if key in self.originals or getattr(fn, "_ulysses", False):
                continue
            self.originals[key] = fn
            setattr(mod, name, wrap(fn))

    def remove(self):
        for (modname, name), fn in list(self.originals.items()):
            setattr(importlib.import_module(modname), name, fn)
            del self.originals[(modname, name)]
        self.reset()


PATCHES = PatchState()
_STATE = PATCHES.settings

# Megatron-LM's flags for a CPU run (gloo, megatron-core's local layers, no fused CUDA kernels)
CPU_FLAGS = (
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion",
)  # fmt: skip

SPEC_FUNCTIONS = {
    "get_gpt_layer_local_spec": "sdpa",
    "get_gpt_layer_with_transformer_engine_spec": "te",
    "get_gpt_decoder_block_spec": None,  # local or TE, chosen by its use_transformer_engine argument
}


def add_ulysses_args(parser):
    """Megatron-LM ``extra_args_provider``: adds ``--ulysses-degree``."""
    g = parser.add_argument_group(title="ulysses sequence parallelism")
    g.add_argument(
        "--ulysses-degree",
        type=int,
        default=1,
        help="Ulysses all-to-all sequence-parallel degree (inner level of context parallelism)",
    )
    g.add_argument(
        "--ulysses-attention-backend",
        choices=["auto", "sdpa", "flash", "te"],
        default="auto",
        help="inner attention kernel (auto: TE with TE specs, SDPA otherwise)",
    )
    g.add_argument(
        "--dynamic-ulysses",
        action="store_true",
        help="refused here: a degree per document runs in the project's trainer (ulysses-mcore pretrain)",
    )
    g.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        help="output layer + cross-entropy this many tokens at a time (no whole logits; default off)",
    )
    g.add_argument(
        "--offload-activation-checkpoints",
        action="store_true",
        help="the tensors the forward saves for the backward (each layer's input under full recompute) in "
        "pinned host memory, prefetched one layer ahead (default off)",
    )
    g.add_argument(
        "--mlp-chunk-tokens",
        type=int,
        default=None,
        help="each MLP this many tokens at a time, recomputed in backward (default off)",
    )
    return parser


def fold_args(args):
    """Fold ``--ulysses-degree`` into Megatron's CP arguments (in place); returns ``args``.

    Raises ``ValueError`` naming the flags when the degrees cannot work; runs on every rank
    before any collective."""
    if getattr(args, "_ulysses_folded", False):
        return args
    ulysses, ring = _check_flags(args)
    args.context_parallel_size = ulysses * ring
    if ulysses > 1 and ring > 1:
        args.hierarchical_context_parallel_sizes = [ulysses, ring]
    args._ulysses_folded = True
    _STATE.update(
        ulysses=ulysses,
        cp=ring,
        backend=getattr(args, "ulysses_attention_backend", "auto"),
        loss_chunk=getattr(args, "loss_chunk_tokens", None),
        mlp_chunk=getattr(args, "mlp_chunk_tokens", None),
        offload=_offload_min_bytes(args) if getattr(args, "offload_activation_checkpoints", False) else 0,
    )
    if ulysses > 1:
        _use_ulysses_in_local_spec()
    return args


def _offload_min_bytes(args) -> int:
    """--offload-activation-checkpoints' threshold of Megatron-LM's flags (context parallel is ulysses x ring here)."""
    shards = (args.context_parallel_size or 1) * (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    return checkpoint_min_bytes(args.seq_length, args.micro_batch_size, args.hidden_size, shards, half)


DYNAMIC_REFUSED = (
    "--dynamic-ulysses does not run through Megatron-LM's pretrain_gpt.py: a degree per document needs every "
    "rank to read and place the whole global batch and a group per micro-batch, while Megatron-LM's data loader "
    "hands each data-parallel rank its own micro-batches for one fixed context-parallel group. Run the same flags "
    "with the project's trainer instead: torchrun ... ulysses-mcore pretrain --ulysses-degree U --dynamic-ulysses "
    "--reset-attention-mask (docs/dynamic.md)"
)


def _check_flags(args):
    """``(ulysses, ring)`` degrees of the flags, or the ``ValueError`` that names the flag."""
    ulysses = getattr(args, "ulysses_degree", 1) or 1
    if ulysses < 1:
        raise ValueError(f"--ulysses-degree must be >= 1, got {ulysses}")
    if getattr(args, "dynamic_ulysses", False):
        raise ValueError(DYNAMIC_REFUSED)
    for flag in ("loss_chunk_tokens", "mlp_chunk_tokens"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1 (leave it out to turn it off), got {v}")
    ring = getattr(args, "context_parallel_size", 1) or 1
    heads = getattr(args, "num_attention_heads", None)
    if heads is not None and ulysses > 1:
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        world = getattr(args, "world_size", None) or tp * ulysses * ring * pp
        groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", True) else None
        Topology(world, tp=tp, ulysses=ulysses, cp=ring, pp=pp).check_model(
            heads, groups, getattr(args, "seq_length", None)
        )
    return ulysses, ring


def _use_ulysses_in_local_spec():
    """megatron.training's GPT builder shares one local-attention spec: make it Ulysses."""
    if "spec" in PATCHES.local_spec:
        _say("core attention: UlyssesAttention (inner kernel sdpa) for megatron.training's local attention backend")
        PATCHES.local_spec["spec"].module = UlyssesAttention
        PATCHES.local_spec["spec"].params = {
            "backend": "sdpa" if _STATE["backend"] in (None, "auto", "te") else _STATE["backend"]
        }


def _say(message: str) -> None:
    """Print on global rank 0 only (``$RANK`` before torch.distributed is up)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"[ulysses-mcore] {message}", flush=True)


def _wrap_validate(fn):
    @functools.wraps(fn)
    def validate_args(args, *a, **kw):
        fold_args(args)
        return fn(args, *a, **kw)

    validate_args._ulysses = True
    return validate_args


def _wrap_init(fn):
    @functools.wraps(fn)
    def initialize_model_parallel(*a, **kw):
        out = fn(*a, **kw)

        remember(_topology_of_parallel_state())
        if _STATE["ulysses"] > 1:
            _say(
                f"parallel axes in force: tp {ps.get_tensor_model_parallel_world_size()} x ulysses "
                f"{_STATE['ulysses']} x cp {_STATE['cp']} x dp {ps.get_data_parallel_world_size()} x pp "
                f"{ps.get_pipeline_model_parallel_world_size()}; Megatron context-parallel size "
                f"{ps.get_context_parallel_world_size()} (ulysses {_STATE['ulysses']} inner x ring {_STATE['cp']})"
            )
        return out

    initialize_model_parallel._ulysses = True
    return initialize_model_parallel


def _topology_of_parallel_state():
    """Megatron-LM's world as a Topology (its order tp-cp-ep-dp-pp is ours with cp = ulysses x ring)."""
    try:
        return Topology(
            dist.get_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            ulysses=max(_STATE["ulysses"], 1),
            cp=_STATE["cp"],
            pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
        )
    except (TopologyError, AssertionError, AttributeError, RuntimeError):
        return None  # a layout Topology does not model (e.g. expert-tensor folding): groups still hold


def _wrap_spec(fn, default_backend):
    @functools.wraps(fn)
    def spec_fn(*a, **kw):

        spec = fn(*a, **kw)
        if _STATE.get("mlp_chunk"):
            spec = swap_mlp(spec, chunk_tokens=_STATE["mlp_chunk"])
        if _STATE["ulysses"] <= 1:  # no --ulysses-degree: Megatron's own attention, untouched
            return spec
        backend = _STATE.get("backend", "auto")
        if backend in (None, "auto"):
            backend = default_backend
            if backend is None:  # decoder block: TE unless use_transformer_engine=False
                backend = "te" if kw.get("use_transformer_engine", True) else "sdpa"
        if fn.__name__ not in PATCHES.said:
            PATCHES.said.add(fn.__name__)
            _say(f"core attention: UlyssesAttention (inner kernel {backend}) in megatron-core's {fn.__name__}")
        return swap_core_attention(spec, backend=backend)

    spec_fn._ulysses = True
    return spec_fn


def _wrap_compile_helpers(fn):
    @functools.wraps(fn)
    def compile_helpers():
        # The megatron-core wheel ships the dataset helpers prebuilt (and no Makefile), so
        # Megatron-LM's start-up `make` fails on a wheel install: build only what is missing.
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None
        return fn()

    compile_helpers._ulysses = True
    return compile_helpers


def _wrap_setup_model(fn):
    """``setup_model_and_optimizer`` (both megatron.training versions build the model there,
    0.19 through its config-container builder): the chunked loss hooked onto each built GPTModel."""

    @functools.wraps(fn)
    def setup_model_and_optimizer(*a, **kw):
        out = fn(*a, **kw)
        models = out[0]
        for m in models if isinstance(models, list) else [models]:
            core = m
            while not hasattr(core, "output_layer") and hasattr(core, "module"):
                core = core.module  # DDP -> Float16Module -> GPTModel
            if _STATE.get("loss_chunk"):
                enable_chunked_loss(core, _STATE["loss_chunk"])
            if _STATE.get("offload"):
                enable_activation_offload(core, min_bytes=_STATE["offload"])
        if _STATE.get("loss_chunk"):
            _say(f"loss: chunked linear cross-entropy, {_STATE['loss_chunk']} tokens at a time")
        if _STATE.get("offload"):
            _say("activation checkpoints: in pinned host memory, prefetched one layer ahead")
        return out

    setup_model_and_optimizer._ulysses = True
    return setup_model_and_optimizer


def _local_core_attention(original):
    """What megatron.training's GPT builder puts in for ``--attention-backend local``."""
    PATCHES.local_spec["spec"] = ModuleSpec(module=original, params={})
    return PATCHES.local_spec["spec"]  # a shared spec: fold_args makes it Ulysses when --ulysses-degree > 1


def _targets():
    """(module, attribute, wrapper) for everything :func:`apply` patches that is importable."""
    out = []
    ps = importlib.import_module("megatron.core.parallel_state")
    out.append((ps, "initialize_model_parallel", _wrap_init))
    out.append((importlib.import_module("megatron.core.datasets.utils"), "compile_helpers", _wrap_compile_helpers))
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    for name, backend in SPEC_FUNCTIONS.items():
        if hasattr(specs, name):
            out.append((specs, name, lambda f, b=backend: _wrap_spec(f, b)))
    # megatron.training's names, where Megatron-LM (or the 0.19 wheel's megatron.training) is there.
    # megatron-core >= 0.19's own GPT builder (megatron.training.models.gpt) forces Megatron's
    # DotProductAttention into the spec when the attention backend is "local"; that name,
    # rebound, gives Ulysses around the local (SDPA) kernel instead.
    for modname, name, wrap in (
        ("megatron.training.arguments", "validate_args", _wrap_validate),
        ("megatron.training.initialize", "validate_args", _wrap_validate),
        ("megatron.training.training", "setup_model_and_optimizer", _wrap_setup_model),
        ("megatron.training.models.gpt", "MCoreDotProductAttention", _local_core_attention),
    ):
        try:
            mod = importlib.import_module(modname)
        except Exception:  # Megatron-LM (megatron.training) not installed: megatron-core alone
            continue
        if hasattr(mod, name):
            out.append((mod, name, wrap))
    # modules that imported the patched functions by name (Megatron-LM's gpt_builders, the
    # 0.19 wheel's GPT model builder)
    for modname in ("gpt_builders", "megatron.training.initialize", "pretrain_gpt", "megatron.training.models.gpt"):
        if modname == "pretrain_gpt":  # a script: patched only if something imported it, never run here
            mod = sys.modules.get(modname)
            if mod is None:
                continue
        else:
            try:
                mod = importlib.import_module(modname)
            except Exception:
                continue
        for name in ("initialize_model_parallel", *SPEC_FUNCTIONS):
            if hasattr(mod, name) and (mod, name) not in [(m, n) for m, n, _ in out]:
                wrap = (
                    _wrap_init
                    if name == "initialize_model_parallel"
                    else (lambda f, b=SPEC_FUNCTIONS[name]: _wrap_spec(f, b))
                )
                out.append((mod, name, wrap))
    return out


def apply():
    """Install the patches (idempotent)."""
    PATCHES.install()


def remove():
    """Undo :func:`apply` (idempotent)."""
    PATCHES.remove()


def is_applied() -> bool:
    return bool(PATCHES.originals)
