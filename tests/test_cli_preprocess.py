"""ulysses-mcore preprocess: text / JSONL -> Megatron's indexed dataset, read back with Megatron's
own reader; a missing input is a clear error."""

import json

from ulysses_mcore.cli import preprocess


def test_jsonl_to_indexed_dataset_read_back_by_megatron(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ("ab", "héllo", "")) + "\n")
    assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "c")]) == 0
    assert "3 documents" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "c"))
    docs = [ds[i].tolist() for i in range(len(ds))]
    eod = docs[0][-1]
    assert docs[0][:-1] == list(b"ab") and docs[1][:-1] == list("héllo".encode()) and docs[2] == [eod]


def test_missing_input_is_named(tmp_path, capsys):
    assert preprocess.main(["--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "--input" in capsys.readouterr().err
