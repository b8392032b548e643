"""One block of the log-sum-exp engine (ulysses_mcore.kernels.blocks): which blocks a window or a ring
shard reaches, and the fused kernel's blocks against the matmul form's."""

import torch

from tests.test_ring import FP32_RTOL, run_hybrid
from ulysses_mcore.kernels import blocks
from ulysses_mcore.kernels.blocks import Block, Scoring, attention_window, tile_segments
from ulysses_mcore.kernels.ring import ring_segments


def test_fused_and_matmul_blocks_agree(monkeypatch):
    """Unmasked fp32 CPU blocks take torch's fused flash kernel; the matmul form must match it."""
    assert Block((0, 8), (0, 8), Scoring((None, 0), 1.0)).fused(torch.zeros(1))  # diagonal: fused
    assert not Block((0, 8), (0, 8), Scoring((None, 0), 1.0, torch.zeros(1, 1, 8, 8, dtype=torch.bool))).fused(
        torch.zeros(1)
    )
    fused = run_hybrid(2, 2, 32, 2, 4, 2, 8, "sbhd", True, "load_balanced")
    monkeypatch.setattr(blocks, "_CPU_FLASH", None)
    matmul = run_hybrid(2, 2, 32, 2, 4, 2, 8, "sbhd", True, "load_balanced")
    assert max(fused) < FP32_RTOL and max(matmul) < FP32_RTOL, (fused, matmul)


def test_window_skips_tiles_outside_it():
    """The tiled kernel computes only the tiles the window reaches: O(s x window) work and
    memory, not O(s^2).  s = 4096, tile 64, causal window 128: 64 query tiles x 3 key tiles."""
    segs = tile_segments([(0, 4096)], 64)
    window = attention_window(True, (128, 0))
    reached = list(blocks.blocks_of(segs, segs, Scoring(window, 1.0)))
    assert len(reached) == 64 * 3 - 3  # tile 0 has no predecessor, tile 1 one
    full = list(blocks.blocks_of(segs, segs, Scoring(attention_window(True, None), 1.0)))
    assert len(full) == 64 * 65 // 2
    # a ring skips whole ring shards beyond the window: C = 4, shards of 16 tokens, window 3
    src_blocks = [
        len(
            list(
                blocks.blocks_of(
                    ring_segments(2, 4, 64, "contiguous"),
                    ring_segments(src, 4, 64, "contiguous"),
                    Scoring(attention_window(True, (3, 0)), 1.0),
                )
            )
        )
        for src in range(4)
    ]
    assert src_blocks == [0, 1, 1, 0]
