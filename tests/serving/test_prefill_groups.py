"""Which prompts the engine prefills together: similar lengths in one left-padded forward, padding bounded."""

from __future__ import annotations

from hf_dspark.serving.prefilling import padding_aware_groups


def test_similar_lengths_share_a_group_and_an_outlier_goes_alone():
    lengths = [120, 30, 100, 110, 400]
    groups = padding_aware_groups(lengths, max_tokens=4096)
    assert groups == [[1], [0, 2, 3], [4]]  # 100-120 padded by 30 of 330 tokens; 30 and 400 each alone


def test_short_prompts_are_grouped_despite_a_large_padding_fraction():
    """A forward's fixed cost is worth more than a few padded tokens: 3- and 9-token prompts go together."""
    assert padding_aware_groups([3, 9, 5], max_tokens=1024) == [[0, 1, 2]]


def test_the_padded_size_stays_within_the_token_budget():
    assert padding_aware_groups([50, 50, 50, 50], max_tokens=120) == [[0, 1], [2, 3]]  # 3 × 50 would be 150


def test_every_prompt_lands_in_exactly_one_group():
    lengths = [17, 3, 250, 64, 65, 66, 900, 12, 12, 300]
    groups = padding_aware_groups(lengths, max_tokens=2048)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        rows, widest, tokens = len(group), max(lengths[i] for i in group), sum(lengths[i] for i in group)
        assert rows * widest <= 2048
        assert rows * widest - tokens <= max(0.25 * tokens, 16 * (rows - 1))
