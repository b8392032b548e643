"""The model's shape: one record read by plan, predict, the sweep, the dry run and the placement.

A :class:`ModelShape` is what every cost and memory formula needs of a GPT and nothing of the run
(the sequence, the batch, the degrees): layers, hidden size, heads, query groups, MLP width,
vocabulary, SwiGLU.  Megatron's own defaults fill what a flag leaves out (query groups = heads,
``ffn_hidden_size`` = 4 x hidden), so every reader sees the same numbers.  Pure Python: no torch,
no Megatron.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None  # None: one per head (Megatron's default)
    ffn_hidden_size: Optional[int] = None  # None: Megatron's default (4 x hidden; 2/3 of it with SwiGLU)
    vocab_size: int = 50304
    swiglu: bool = False
    kv_channels: Optional[int] = None  # None: hidden / heads (Megatron's default)
    qk_layernorm: bool = False  # per-head query and key norms (--qk-layernorm)

    def __post_init__(self):
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            ffn = int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size
            object.__setattr__(self, "ffn_hidden_size", ffn)

    @classmethod
    def from_args(cls, args, vocab_size: Optional[int] = None) -> ModelShape:
        """The shape of parsed flags (Megatron's names; ``vocab_size`` overrides the flags' own, e.g.
        with Megatron's padding applied)."""
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=getattr(args, "num_query_groups", None) or None,
            ffn_hidden_size=getattr(args, "ffn_hidden_size", None) or None,
            vocab_size=vocab_size or args.vocab_size,
            swiglu=bool(getattr(args, "swiglu", False)),
            kv_channels=getattr(args, "kv_channels", None) or None,
            qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        )

    @property
    def head_dim(self) -> int:
        """Channels of one head: ``--kv-channels``, else hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_hidden(self) -> int:
        """Width of k (or v): the query groups' heads."""
        return self.num_query_groups * self.head_dim

    def work(self) -> Dict[str, float]:
        """What one layer does, counted once for every cost (the step-time model's features, the
        dynamic placement's costs): forward FLOPs per token of the MLP (``mlp``) and of the QKV and
        output projections (``projections``), per causal (query, key) pair of a document
        (``attention``: q.k and p.v over every head), of the output layer per token (``logits``,
        once, not per layer), and the elements its all-to-alls move per token (``exchanged``: q, k, v
        to the heads, the output back).  The backward is twice the forward."""
        h, q_width, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.kv_hidden
        return {
            "mlp": 2 * h * self.ffn_hidden_size * (3 if self.swiglu else 2),
            "projections": 2 * (h * (q_width + 2 * kv) + q_width * h),
            "attention": 4 * q_width,
            "logits": 2 * h * self.vocab_size,
            "exchanged": 2 * q_width + 2 * kv,
        }

    def keywords(self) -> Dict:
        """The fields by name (the memory model's keywords)."""
        return asdict(self)

    def flags(self) -> List[str]:
        """The trainer's flags of this shape (the vocabulary comes from the tokenizer, not a flag)."""
        flags = [
            "--num-layers",
            self.num_layers,
            "--hidden-size",
            self.hidden_size,
            "--num-attention-heads",
            self.num_attention_heads,
            "--group-query-attention",
            "--num-query-groups",
            self.num_query_groups,
            "--ffn-hidden-size",
            self.ffn_hidden_size,
        ]
        flags += ["--kv-channels", self.kv_channels] if self.kv_channels else []
        flags += ["--qk-layernorm"] if self.qk_layernorm else []
        return [str(f) for f in flags] + (["--swiglu"] if self.swiglu else [])


# Llama-style, SwiGLU, GQA; "tiny" is what a 2-core CPU world trains in seconds
MODELS: Dict[str, ModelShape] = {
    "tiny": ModelShape(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=384,
        vocab_size=384,
    ),
    "llama8b": ModelShape(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        swiglu=True,
    ),
    "llama70b": ModelShape(
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=28672,
        vocab_size=128256,
        swiglu=True,
    ),
}


def model_named(name: str) -> ModelShape:
    """A preset by name, or the error naming ``--model`` and the choices."""
    if name not in MODELS:
        raise ValueError(f"--model {name!r} is unknown: use one of {sorted(MODELS)}")
    return MODELS[name]


__all__ = ["ModelShape", "MODELS", "model_named"]
