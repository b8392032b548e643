"""ulysses-mcore: Ulysses sequence parallelism (all-to-all attention) for Megatron-Core."""

from .attention import UlyssesAttention, ulysses_attention
from .comm import HeadPlan, head_to_seq, seq_to_head
from .state import get_ulysses_group, set_ulysses_group

__version__ = "0.1.0"

__all__ = [
    "HeadPlan",
    "UlyssesAttention",
    "get_ulysses_group",
    "head_to_seq",
    "seq_to_head",
    "set_ulysses_group",
    "ulysses_attention",
]
