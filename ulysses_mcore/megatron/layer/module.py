"""``UlyssesAttention``: Megatron-Core's ``core_attention`` slot filled with Ulysses.

Builder keywords and forward signature are Megatron's, so it goes into a layer spec in place of
``DotProductAttention`` / ``TEDotProductAttention`` (:mod:`ulysses_mcore.megatron.layer.specs`).  The
groups are given, one way each: by the caller (``ulysses_group`` / ``ring_group``), or by
Megatron -- the ``pg_collection`` it hands the layer (parallel_state's when it hands none): its
context-parallel group, split into its two hierarchical levels when the config's
``hierarchical_context_parallel_sizes`` names two
(:func:`ulysses_mcore.megatron.layer.groups.sequence_groups`).  Validation runs
once per input signature (each instance has a :class:`~ulysses_mcore.call.CallCache` that
prepares each signature once); in steady state a forward is two all-to-alls and nothing else.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from ulysses_mcore.call import CallCache
from ulysses_mcore.exchange.heads import HeadPlan, head_layout_error
from ulysses_mcore.exchange.orders import BATCH
from ulysses_mcore.kernels.registry import Kernel, resolve
from ulysses_mcore.kernels.te import TEAttention
from ulysses_mcore.megatron.layer.groups import group_size, mpu_collection, sequence_groups
from ulysses_mcore.megatron.layer.offload import prefetch_point
from ulysses_mcore.megatron.layer.rotary import RotaryKernel
from ulysses_mcore.options import NO_TENSORS, CallSite, CallTensors, backend_error, call_site
from ulysses_mcore.planning.placement import powers_of_two


def _given_groups(config, pg_collection, ulysses_group, ring_group):
    """The caller's groups when it gives any; else Megatron's: the collection it hands the layer,
    else parallel_state's."""
    if ulysses_group is not None or ring_group is not None:
        return ulysses_group, ring_group
    levels = getattr(config, "hierarchical_context_parallel_sizes", None)
    return sequence_groups(levels, pg_collection or mpu_collection())


def _host_int(value) -> Optional[int]:
    """Megatron's ``max_seqlen_q``: an int on the host, or ``None`` (never read off a device tensor)."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return int(value)
    return None


def _document_lengths(cu: torch.Tensor) -> torch.Tensor:
    return cu[1:] - cu[:-1]


def _tp_size_and_rank(tp_group):
    """Tensor-parallel (size, rank): of Megatron's ``pg_collection.tp`` when given, else of parallel_state."""
    if tp_group is not None:
        return dist.get_world_size(tp_group), dist.get_rank(tp_group)

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


class UlyssesAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron-Core's ``SelfAttention``.

    Builder keywords are Megatron's (``config, layer_number, attn_mask_type,
    attention_type, attention_dropout, softmax_scale, cp_comm_type, pg_collection``, and MLA's
    ``k_channels, v_channels``) plus ``ulysses_group`` / ``ring_group`` (default: Megatron's, from
    ``pg_collection``: :func:`~ulysses_mcore.megatron.layer.groups.sequence_groups`) and ``backend``
    (``"sdpa"``, ``"flash"``, ``"te"`` or a callable).

    Forward takes Megatron's ``query [s/P, b, hq, d]``, ``key``/``value [s/P, b, hk, d]``
    for the local token shard and returns ``[s/P, b, hq*d]``.  ``attn_mask_type`` causal
    ignores ``attention_mask`` (as Transformer Engine does); padding / arbitrary masks must
    cover the full sequence ``[b or 1, 1 or heads, s, s]`` (True = masked).

    Megatron's attention variants come from the config: ``window_size`` (with
    ``window_attn_skip_freq``), ``softmax_type`` ``"off-by-one"`` / ``"learnable"`` (the learnable
    sinks are this module's parameter ``softmax_offset``, one per query head of the tensor-parallel
    rank, saved sharded on dim 0 like Megatron's), and multi-latent attention (``MLASelfAttention``
    passes value heads of their own size; the output is ``[s/P, b, h*dv]``).

    With ``config.context_parallel_size = ulysses x cp`` the ring group runs ring attention
    after the all-to-all.  ``packed_seq_params`` (``thd``): ``cu_seqlens_q`` are the global
    document boundaries of the packed stream (:func:`ulysses_mcore.megatron.layer.batch.packed_seq_params`);
    with ``cu_seqlens_q_padded`` (Megatron-LM / TE: documents padded between each other) the
    tokens sit at the padded offsets and the pads are neither queries nor keys.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        ulysses_group=None,
        backend: Union[str, Kernel] = "sdpa",
        check: bool = True,
        token_order: Optional[str] = None,
        ring_group=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        dynamic=None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        self.check = check
        self.current_max_attn_logits = None
        # Megatron shards a sequence over its context-parallel axis (which is Ulysses x ring
        # here) in dual-chunk order, and slices RoPE to match: follow it by default.
        cp_size = getattr(config, "context_parallel_size", 1)
        self.token_order = token_order or ("load_balanced" if cp_size > 1 else "contiguous")

        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        tp, self.tp_rank = _tp_size_and_rank(tp_group)
        self.tp_group = tp_group
        self.group, self.ring_group = _given_groups(config, pg_collection, ulysses_group, ring_group)
        self.ulysses, self.ring = group_size(self.group), group_size(self.ring_group)
        self.dynamic = dynamic  # --dynamic-ulysses: each micro-batch brings its group (PackedSeqParams.cp_group)
        self.calls = CallCache(self._site)  # prepared calls by (causal, layout, token order, group, dropout)
        self._check_context_parallel(cp_size)
        self._heads(config, tp, dynamic.max_ulysses if dynamic else 1)
        # MLA passes k_channels (query/key head dim, for the default scale) and v_channels (value head
        # dim: the output's, read from the value itself), as to TE's module
        self.head_dim = k_channels or config.kv_channels
        # sliding window, per layer as Megatron decides it (window_attn_skip_freq: some layers full)
        self.window_size = None
        if is_layer_window_attention(
            getattr(config, "window_size", None), getattr(config, "window_attn_skip_freq", None), layer_number
        ):
            self.window_size = tuple(int(x) for x in config.window_size)
        self._sinks(config)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.te_attention = self._te_child(v_channels or self.head_dim) if backend == "te" else None
        self.rotary = self._rotary(config) if dynamic is not None and dynamic.rope else None

    def _rotary(self, config):
        """--dynamic-ulysses: RoPE after the exchange, around the kernel (docs/dynamic.md); a plain
        object, not a child module (it holds no state)."""
        return RotaryKernel(self.te_attention or resolve(self.backend), config)

    def _te_child(self, dv: int):
        """Transformer Engine's attention for the heads this rank holds after the exchange, built once
        from the spec's layer: a child module (layer number, FP8 metadata, state in checkpoints)."""
        err = backend_error("te")
        if err:
            raise ValueError(f"UlyssesAttention(backend='te'): {err}")
        plan = HeadPlan(self.num_q_heads, self.num_kv_heads, self.ulysses)
        rank = dist.get_rank(self.group) if self.ulysses > 1 else 0
        lo, hi = plan.q_range(rank)
        kv = hi - lo if self.ulysses > 1 and plan.kv_index_for_q(rank) is not None else plan.kv_count(rank)
        return TEAttention(
            hi - lo,
            kv,
            self.head_dim,
            dv,
            softmax_scale=self.softmax_scale,
            dropout_p=self.dropout_p,
            layer_number=self.layer_number,
            ring_group=self.ring_group,
        )

    def _check_context_parallel(self, cp_size: int) -> None:
        if (cp_size > 1 or self.ring > 1) and cp_size != self.ulysses * self.ring:
            raise ValueError(
                f"config.context_parallel_size={cp_size} but the Ulysses group has {self.ulysses} ranks and the "
                f"ring {self.ring}: Megatron's context-parallel size must be --ulysses-degree x "
                "--context-parallel-size; build the groups with ulysses_mcore.initialize(ulysses=..., cp=...)"
            )

    def _heads(self, config, tp: int, max_ulysses: int = 1) -> None:
        """Head counts per tensor-parallel rank, on the instance (never in process-global state),
        checked against the degree (and, ``--dynamic-ulysses``, every power of two up to its largest)."""
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        if heads % tp or groups % tp:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} must divide --num-attention-heads {heads} "
                f"and --num-query-groups {groups}"
            )
        self.num_q_heads, self.num_kv_heads = heads // tp, groups // tp
        self.checks = (("expected_heads", (self.num_q_heads, self.num_kv_heads)),)
        for d in sorted({self.ulysses, *powers_of_two(max_ulysses)}):
            self._head_layout(config, tp, d)

    def _head_layout(self, config, tp: int, ulysses: int) -> None:
        err = head_layout_error(self.num_q_heads, self.num_kv_heads, ulysses)
        if err:
            heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
            raise ValueError(
                f"--ulysses-degree {ulysses} does not fit the heads per tensor-parallel rank "
                f"(tp={tp}, --num-attention-heads {heads}, --num-query-groups {groups}): {err}"
            )

    def _sinks(self, config) -> None:
        """Attention sinks as Megatron's ``softmax_type`` says: "off-by-one" a zero logit per head;
        "learnable" a per-head parameter, sharded over tensor parallelism, replicated over Ulysses /
        ring / dp."""
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.num_q_heads), persistent=False)
        elif self.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(self._initial_sinks(config, config.num_attention_heads))

            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif self.softmax_type == "vanilla":
            self.softmax_offset = None
        else:
            raise ValueError(
                f"config.softmax_type={self.softmax_type!r} is unknown: use 'vanilla', 'off-by-one' or 'learnable'"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        cu, lens, cu_kv, order, max_len = None, None, None, self.token_order, None
        if packed_seq_params is not None:
            cu, lens, cu_kv, order = self._packed(packed_seq_params)
            max_len = _host_int(getattr(packed_seq_params, "max_seqlen_q", None))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        mask = None if mask_type in (AttnMaskType.causal, AttnMaskType.no_mask) or cu is not None else attention_mask
        group = self.group
        if self.dynamic is not None:  # the slot's group, handed over by the trainer with the micro-batch
            group = getattr(packed_seq_params, "cp_group", None)
        dropout = self.dropout_p if self.training else 0.0
        choices = (causal, "thd" if cu is not None else "sbhd", order, group, dropout)
        tensors = NO_TENSORS
        if mask is not None or attention_bias is not None or cu is not None or self.softmax_offset is not None:
            tensors = CallTensors(
                attention_mask=mask,
                attention_bias=attention_bias,
                cu_seqlens=cu,
                seqlens=lens,
                softmax_offset=self.softmax_offset,
                max_seqlen=max_len,
            )
        if packed_seq_params is not None:  # the module's own checks of Megatron's packed-sequence record
            tensors = tensors._replace(cu_seqlens_kv=cu_kv, qkv_format=getattr(packed_seq_params, "qkv_format", None))
        out = self.calls.run(prefetch_point(query), key, value, choices, tensors)
        if cu is not None:
            return out.reshape(out.shape[0], -1)  # [t, h*d]; Megatron adds the batch dim back
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _site(self, choices) -> CallSite:
        """This module's call site for ``(causal, layout, token order, group, dropout)``: built when
        its first signature is prepared, then held by the prepared call."""
        causal, layout, order, group, dropout = choices
        return call_site(
            causal,
            layout=layout,
            backend=self.backend,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout,
            token_order=order,
            window_size=self.window_size,
            group=group,
            ring_group=self.ring_group,
            first_head=self.tp_rank * self.num_q_heads,
            checks=self.checks,
            kernel=self.rotary or self.te_attention,
            check=self.check,
        )

    def _initial_sinks(self, config, heads: int) -> torch.Tensor:
        """The learnable sinks' first values: all ``heads`` drawn from a generator keyed by the layer
        (normal, ``init_method_std``), this tensor-parallel rank's slice kept -- the same model for
        any layout; zeros without ``perform_initialization`` (a checkpoint will fill them)."""
        full = torch.zeros(heads)
        if getattr(config, "perform_initialization", True):
            gen = torch.Generator().manual_seed(7919 * self.layer_number + 17)
            full.normal_(0.0, getattr(config, "init_method_std", 0.02), generator=gen)
        lo = self.tp_rank * self.num_q_heads
        return full[lo : lo + self.num_q_heads].to(getattr(config, "params_dtype", torch.float32))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks, sharded over tensor parallelism on dim 0 (as Megatron's own
        ``DotProductAttention`` saves them), so a checkpoint is the same for any layout; the
        Transformer Engine child's state (its ``_extra_state``: FP8 metadata) as Megatron saves TE's."""
        learnable = self.softmax_type == "learnable"
        if not learnable and self.te_attention is None:
            return {}

        kw = {}
        params = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
        if "tp_group" in params:
            kw["tp_group"] = self.tp_group or parallel_state.get_tensor_model_parallel_group()
        if "dp_cp_group" in params:
            dp_cp = (metadata or {}).get("dp_cp_group")
            kw["dp_cp_group"] = dp_cp or parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"softmax_offset": 0} if learnable else {},
            sharded_offsets,
            **kw,
        )

    def _packed(self, psp):
        """(cu_seqlens for the kernel, real lengths or None, cu_seqlens_kv, token order) of
        Megatron's ``PackedSeqParams``, from tensor shapes only (no device sync)."""
        real, padded = psp.cu_seqlens_q, getattr(psp, "cu_seqlens_q_padded", None)
        order = self.token_order
        # one padded slot [0, total]: the stream sharded whole (this package's pack_batch + shard_batch);
        # more: Transformer Engine's / Megatron-LM's per-document layout, documents padded to 2 x CP
        per_document = padded is not None and padded.numel() > 2
        if per_document and self.ulysses * self.ring > 1:
            order = "per_document"
        if not per_document:
            return real, None, getattr(psp, "cu_seqlens_kv", None), order
        # tokens sit at their padded offsets; real lengths say where each document's pad starts
        return padded, None if real is None else BATCH.derived("document lengths", _document_lengths, real), None, order
