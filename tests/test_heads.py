"""Medusa heads: zero-initialised identity blocks, separate weights per block, projections, subsets of heads."""

import pytest
import torch

from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads

from .conftest import random_heads


def test_untrained_blocks_are_the_identity_and_never_share_weights():
    heads = MedusaHeads(HeadsConfig(hidden_size=8, vocab_size=11, num_heads=3, num_layers=2))
    hidden = torch.randn(5, 8)
    assert torch.equal(heads.features(hidden), hidden.expand(3, 5, 8))
    params = [p.data_ptr() for p in heads.parameters()]
    assert len(params) == len(set(params)) == 3 * 2 * 2  # weight and bias of 2 blocks for each of 3 heads


def test_own_projections_start_as_the_targets():
    lm_head = torch.nn.Linear(8, 11, bias=False)
    heads = MedusaHeads(HeadsConfig(8, 11, num_heads=2, shared_lm_head=False), lm_head.weight)
    hidden = torch.randn(3, 8)
    torch.testing.assert_close(heads(hidden), lm_head(hidden).expand(2, 3, 11))
    with pytest.raises(ValueError, match="lm_head weight has shape"):
        heads.init_projections_from(torch.zeros(11, 9))


def test_a_subset_of_heads_gives_the_same_logits():
    heads = random_heads(num_heads=4)
    lm_head = torch.nn.Linear(heads.config.hidden_size, heads.config.vocab_size, bias=False)
    hidden = torch.randn(2, heads.config.hidden_size)
    full = heads(hidden, lm_head)
    assert full.shape == (4, 2, heads.config.vocab_size)
    torch.testing.assert_close(heads(hidden, lm_head, num_heads=2), full[:2])
    with pytest.raises(ValueError, match="pass it as `lm_head`"):
        heads(hidden)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_heads", "num_layers"])
def test_config_rejects_non_positive_sizes(field):
    values = dict(hidden_size=8, vocab_size=11, num_heads=2, num_layers=1)
    values[field] = 0
    with pytest.raises(ValueError, match=f"HeadsConfig.{field} must be a positive integer"):
        HeadsConfig(**values)
