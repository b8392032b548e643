"""The trainer's data feed (ulysses_mcore.megatron.trainer.feed): the embedded corpus indexed as
Megatron reads it (every document, in order, byte for byte), built under a private name and renamed
into place; the ranks that share a sequence agreeing on its packed documents."""

from megatron.core.datasets.indexed_dataset import IndexedDataset

from ulysses_mcore.megatron.trainer import data as D
from ulysses_mcore.megatron.trainer.feed import _index_embedded_corpus


def test_the_embedded_corpus_indexes_every_document_for_megatron(tmp_path):
    tok = D.ByteTokenizer()
    prefix = str(tmp_path / "kjv")
    _index_embedded_corpus(prefix, tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kjv.bin", "kjv.idx"]  # no temporary left
    docs = list(D.read_documents(D.EMBEDDED_CORPUS))
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    for i in (0, len(docs) // 2, len(docs) - 1):
        assert ds[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]


def test_ranks_sharing_a_sequence_agree_on_its_documents(monkeypatch):
    """--reset-attention-mask: the packed boundaries of a step are agreed once (one all-reduce over the
    ranks that share a sequence, on host tensors); ranks that read the same documents pass, one rank
    that read others makes every rank raise the same error naming the flags to check."""
    import torch
    import torch.distributed as dist

    from ulysses_mcore.megatron.trainer import feed
    from tests.helpers import run_threaded, run_threaded_errors

    monkeypatch.setattr(feed.ps, "get_context_parallel_group", lambda: dist.group.WORLD)

    def packed(bounds):
        return [{"cu_seqlens": torch.tensor(b, dtype=torch.int32)} for b in bounds]

    same = [[0, 5, 16], [0, 16]]
    assert run_threaded(4, lambda r, w: feed._agree_on_boundaries(packed(same)) or True) == [True] * 4
    errs = run_threaded_errors(4, lambda r, w: feed._agree_on_boundaries(packed(same if r else [[0, 6, 16], [0, 16]])))
    assert all(isinstance(e, ValueError) for e in errs), errs
    assert len({str(e) for e in errs}) == 1 and "--data-path, --split and --seed" in str(errs[0])
