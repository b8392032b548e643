"""ulysses_mcore.megatron.trainer.loss: token-weighted sums (never a mean of means), against a direct sum."""

import pytest
import torch

from ulysses_mcore.megatron.trainer.loss import check_config, global_mean, masked_token_loss


def test_masked_token_loss_sums_only_kept_tokens():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    total, count, report = masked_token_loss(mask, losses)
    assert total.item() == 10.0 and count.item() == 3
    assert report["lm loss"].tolist() == [10.0, 3.0]


def test_global_mean_weights_by_tokens(monkeypatch):
    """Two micro-batches of 3 and 1 tokens: the mean is over the 4 tokens, not of the two means
    (one rank: no process group, nothing to reduce)."""
    from ulysses_mcore.megatron.trainer import loss

    monkeypatch.setattr(loss.dist, "is_initialized", lambda: False)
    a = masked_token_loss(torch.ones(1, 3), torch.tensor([[1.0, 1.0, 1.0]]))[2]
    b = masked_token_loss(torch.ones(1, 1), torch.tensor([[5.0]]))[2]
    mean, count = global_mean([a, b], group=object())
    assert count == 4 and mean == pytest.approx(2.0)
    assert global_mean([], group=None)[1] == 0


def test_config_must_weight_by_tokens():
    class Cfg:
        calculate_per_token_loss = False

    with pytest.raises(ValueError, match="calculate_per_token_loss=True"):
        check_config(Cfg())
