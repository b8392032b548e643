"""ulysses_mcore.megatron.layer.batch: sharding of Megatron batches (labels shifted before sharding,
masks), without spawning processes."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ulysses_mcore.megatron.layer import batch as B


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_shards_reassemble_and_keep_shifted_labels(b, S, ulysses, lb):
    text = torch.randint(0, 100, (b, S + 1))
    full = B.make_lm_batch(text)
    mult = ulysses * (2 if lb else 1)
    padded = B.pad_batch(full, mult, pad_token_id=-1)
    assert padded["tokens"].shape[1] % mult == 0
    shards = [
        B.shard_batch(full, rank=r, ulysses=ulysses, load_balanced=lb, pad_to_multiple_of=mult, pad_token_id=-1)
        for r in range(ulysses)
    ]
    # every (token, label, position) triple of the full batch appears exactly once
    seen = {}
    for s in shards:
        for t, lab, p, m in zip(
            s["tokens"].flatten().tolist(),
            s["labels"].flatten().tolist(),
            s["position_ids"].flatten().tolist(),
            s["loss_mask"].flatten().tolist(),
        ):
            seen.setdefault(p, []).append((t, lab, m))
    for p in range(S):
        tokens_at_p = list(seen[p])
        assert len(tokens_at_p) == b
        assert sorted(tokens_at_p) == sorted(zip(text[:, p].tolist(), text[:, p + 1].tolist(), [1.0] * b))
    for p in range(S, padded["tokens"].shape[1]):
        assert all(m == 0.0 for _, _, m in seen[p])  # padding is masked out of the loss


def test_last_token_of_a_shard_keeps_its_label():
    text = torch.arange(17).unsqueeze(0)  # tokens 0..15, labels 1..16
    s0 = B.shard_batch(B.make_lm_batch(text), rank=0, ulysses=2, load_balanced=False)
    assert s0["tokens"][0, -1].item() == 7 and s0["labels"][0, -1].item() == 8  # 8 lives on shard 1
    lb = B.shard_batch(B.make_lm_batch(text), rank=1, ulysses=2, load_balanced=True)
    assert lb["tokens"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    assert lb["position_ids"][0].tolist() == list(range(4, 12))


def test_indivisible_length_names_the_fix():
    full = B.make_lm_batch(torch.zeros(1, 31, dtype=torch.long))
    with pytest.raises(ValueError, match="pad_to_multiple_of=8"):
        B.shard_batch(full, rank=0, ulysses=4, load_balanced=True)


def test_padding_masks_attention_mask_keys():
    full = B.make_lm_batch(torch.zeros(2, 7, dtype=torch.long))
    full["attention_mask"] = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    out = B.pad_batch(full, 4)
    m = out["attention_mask"]
    assert m.shape == (2, 1, 8, 8) and m[..., 6:].all() and not m[..., :6, :6].any()
