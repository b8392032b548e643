"""ulysses_mcore.exchange.overlap: head chunks pipelined with asynchronous all-to-alls, against float64
full attention; 2C collectives each way; the chunk counts it refuses."""

import pytest
import torch.distributed as dist

import ulysses_mcore
from tests.helpers import count_collectives, run_threaded, run_threaded_errors
from tests.test_attention import FP32_RTOL, make_inputs, run_case


@pytest.mark.parametrize(
    "P,hq,hk,layout,chunks,mask",
    [
        (2, 8, 8, "sbhd", 2, False),
        (2, 8, 8, "sbhd", 4, True),
        (2, 8, 4, "bshd", 2, True),
        (4, 16, 8, "sbhd", 2, False),
        (2, 8, 4, "sbhd", 2, False),
    ],
)
def test_overlapped_chunks_match_reference(P, hq, hk, layout, chunks, mask):
    errs = run_case(P, 8 * P, 2, hq, hk, 8, layout, True, mask=mask, bias=mask, chunks=chunks)
    assert max(errs) < FP32_RTOL, errs


def test_overlap_collective_count_and_rejection():
    q, k, v, dout, _, _ = make_inputs(5, 16, 1, 8, 8, 8, "sbhd")

    def rank_fn(rank, world):
        qs, ks, vs = (t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v))
        a0 = c.get("all_to_all_single")
        out = ulysses_mcore.ulysses_attention(
            qs, ks, vs, group=dist.group.WORLD, causal=True, overlap_chunks=4, check=False
        )
        a1 = c.get("all_to_all_single")
        out.backward(dout.chunk(world)[rank])
        return a1 - a0, c.get("all_to_all_single") - a1

    with count_collectives() as c:
        fwd, bwd = run_threaded(2, rank_fn)[0]
    assert (fwd, bwd) == (8, 8)  # 2 x chunks each way
    q2, k2, v2, _, _, _ = make_inputs(6, 16, 1, 8, 2, 8, "sbhd")
    errs = run_threaded_errors(
        4,
        lambda r, w: ulysses_mcore.ulysses_attention(
            q2.chunk(w)[r], k2.chunk(w)[r], v2.chunk(w)[r], group=dist.group.WORLD, causal=True, overlap_chunks=2
        ),
    )
    assert all(isinstance(e, ValueError) and "overlap_chunks=2" in str(e) for e in errs), errs
