"""ulysses_mcore.megatron.trainer.data: the byte tokenizer, Megatron's indexed dataset written and checked,
and the global-batch sampler's split over data-parallel ranks."""

import pytest
import torch

from ulysses_mcore.megatron.trainer.data import (
    ByteTokenizer,
    GlobalBatchSampler,
    check_indexed_dataset,
    write_indexed_dataset,
)


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


def test_a_split_left_without_documents_is_refused_before_megatron_loops(tmp_path):
    """Four documents (one of 20,184 tokens, three short), the trainer's default --split 98,2,0: the
    validation split gets none (Megatron's builder would loop in _get_num_epochs); refused at once,
    naming the split, the counts and the fix.  --split 100,0,0 and 3,1,0 build."""
    import time

    from ulysses_mcore.megatron.trainer.data import build_gpt_datasets, split_documents, split_problem

    prefix = str(tmp_path / "four")
    write_indexed_dataset(["word " * 4036 + "word", "a", "b", "c"], prefix, ByteTokenizer(), progress=False)
    assert split_documents(4, "98,2,0") == [4, 0, None] and split_documents(400, "98,2,0") == [392, 8, None]
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        build_gpt_datasets(prefix, seq_length=1024, seed=1, split="98,2,0", samples=[240, 16, 0])
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "--split 98,2,0" in msg and "validation" in msg and "4 documents" in msg and "--split 100,0,0" in msg
    assert split_problem(prefix, "100,0,0") == "" and split_problem(prefix, "3,1,0") == ""
    train, valid, _ = build_gpt_datasets(prefix, seq_length=1024, seed=1, split="3,1,0", samples=[8, 2, 0])
    assert len(train) >= 8 and len(valid) >= 2
