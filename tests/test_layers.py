"""The layering: the core imports torch only; Megatron lives in the adapter."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_runs_with_megatron_blocked():
    """``import megatron`` made impossible: the functional API still imports and gives exact
    attention in a threaded world of 2 (compared with float64 full attention)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["megatron"] = None  # any import of megatron.* now raises ImportError
        import torch, torch.distributed as dist
        import ulysses_mcore
        from ulysses_mcore import attention, exchange, validation, ring, overlap, backends, topology, state
        from tests.helpers import reference_attention, run_threaded
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(16, 2, 4, 8, generator=g) for _ in range(3))
        def fn(rank, world):
            qs, ks, vs = (t.chunk(world)[rank] for t in (q, k, v))
            return ulysses_mcore.ulysses_attention(qs, ks, vs, group=dist.group.WORLD, causal=True)
        out = torch.cat(run_threaded(2, fn))
        ref = reference_attention(q, k, v, causal=True)
        assert (out.double() - ref).abs().max() < 1e-5
        assert not any(m.startswith("megatron") and sys.modules[m] is not None for m in sys.modules)
        try:
            ulysses_mcore.UlyssesAttention
        except ImportError:
            print("adapter needs megatron: ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "adapter needs megatron: ok" in res.stdout
