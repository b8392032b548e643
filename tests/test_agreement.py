"""ulysses_mcore.validation.agreement: the digests are the same in every process for the same call and differ
for different boundaries; one all-reduce tells every rank whether all agree."""

import torch
import torch.distributed as dist

from tests.helpers import count_collectives, run_threaded
from ulysses_mcore.validation.agreement import agree_call, boundaries_digest


def test_boundaries_digest_tells_documents_apart_without_a_host_read():
    d = lambda *b: int(boundaries_digest(torch.tensor(b), torch.device("cpu")))  # noqa: E731
    assert d(0, 10, 32) == d(0, 10, 32)
    assert len({d(0, 10, 32), d(0, 20, 32), d(0, 10, 20, 32), d(0, 32)}) == 4
    assert int(boundaries_digest(None, torch.device("cpu"))) == 0


def test_agree_call_is_one_all_reduce_and_the_same_answer_everywhere():
    def fn(rank, world):
        cu = torch.tensor([0, 10, 32] if rank == 0 else [0, 20, 32])
        same_sig = agree_call(7, (None, None), rank == 1, dist.group.WORLD, torch.device("cpu"))
        other_sig = agree_call(7 + rank, (None, None), False, dist.group.WORLD, torch.device("cpu"))
        other_docs = agree_call(7, (cu, None), False, dist.group.WORLD, torch.device("cpu"))
        return same_sig, other_sig, other_docs, c.get("all_reduce")

    with count_collectives() as c:
        res = run_threaded(2, fn)
    assert res[0] == res[1] == ((True, True), (False, False), (False, False), 3)  # one all-reduce a call
