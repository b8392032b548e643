"""ulysses_mcore.megatron.data: the byte tokenizer, Megatron's indexed dataset written and checked,
and the global-batch sampler's split over data-parallel ranks."""

import pytest
import torch

from ulysses_mcore.megatron.data import ByteTokenizer, GlobalBatchSampler, check_indexed_dataset, write_indexed_dataset


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.tokenize("In the beginning — Genesis")
    assert max(ids) < 256 and tok.detokenize(ids + [tok.eod]) == "In the beginning — Genesis"


def test_indexed_dataset_written_checked_and_damage_named(tmp_path):
    prefix = str(tmp_path / "corpus")
    docs = ["first document", "second, longer document", "third"]
    info = write_indexed_dataset(docs, prefix, ByteTokenizer(), progress=False)
    assert info["documents"] == 3
    assert check_indexed_dataset(prefix) == sum(len(d.encode()) + 1 for d in docs)  # + one EOD each
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="truncated"):
        check_indexed_dataset(prefix)
    with pytest.raises(FileNotFoundError, match="missing"):
        check_indexed_dataset(str(tmp_path / "nothing"))


def test_sampler_splits_a_global_batch_over_dp_ranks():
    ds = [{k: torch.tensor([i]) for k in ("tokens", "labels", "loss_mask", "position_ids")} for i in range(10)]
    seen = []
    for rank in range(2):
        mbs = GlobalBatchSampler(ds, global_batch_size=4, micro_batch_size=1, dp_size=2, dp_rank=rank).microbatches(4)
        seen += [int(mb["tokens"]) for mb in mbs]
    assert seen == [4, 5, 6, 7]  # global batch 2 = samples 4..7, each rank its half
    with pytest.raises(ValueError, match="--global-batch-size 3"):
        GlobalBatchSampler(ds, global_batch_size=3, micro_batch_size=1, dp_size=2, dp_rank=0)
