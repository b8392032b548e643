"""The trainer's data feed (ulysses_mcore.megatron.trainer.feed): the embedded corpus indexed as
Megatron reads it (every document, in order, byte for byte), built under a private name and renamed
into place."""

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
