"""The seeded long-tailed document mix of the --dynamic-ulysses benchmark and tests."""

import json

from ulysses_mcore.planning.mix import long_tailed_lengths, write_jsonl


def test_the_mix_rule_is_seeded_and_long_tailed():
    a = long_tailed_lengths(500, seed=5, median=200, longest=4096, whole_every=25)
    assert a == long_tailed_lengths(500, seed=5, median=200, longest=4096, whole_every=25)
    assert a != long_tailed_lengths(500, seed=6, median=200, longest=4096, whole_every=25)
    assert a.count(4096) >= 20 and min(a) >= 8 and max(a) <= 4096
    assert sorted(a)[250] < 400  # most documents short


def test_jsonl_has_one_document_a_line_of_the_given_lengths(tmp_path):
    lengths = long_tailed_lengths(20, seed=2, median=50, longest=300)
    path = tmp_path / "mix.jsonl"
    assert write_jsonl(str(path), lengths, seed=2) == sum(lengths)
    docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert [len(d) for d in docs] == lengths and all(set(d) <= set("abcdefghijklmnopqrstuvwxyz ") for d in docs)
