"""RowTokens: host lists are the record, the device mirror's views are slices equal to them, drafts are written
into the free tail so prefix + drafts is a slice too; the output is plain generate's right-padded batch."""

from __future__ import annotations

import torch

from hf_dspark.speculation.row_tokens import RowTokens


def _tokens(mirror: bool) -> RowTokens:
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    return RowTokens(ids, (ids != 0).long(), capacity=8, mirror=mirror)


def test_views_follow_the_host_lists():
    for mirror in (True, False):
        tokens = _tokens(mirror)
        tokens.append(0, [11, 12])
        tokens.append(1, [13])
        assert tokens.view(0).tolist() == [0, 0, 5, 6, 11, 12] and tokens.own_view(0).tolist() == [5, 6, 11, 12]
        assert tokens.own_view(1).tolist() == [7, 8, 9, 10, 13] and tokens.generated(0) == [11, 12]
        assert tokens.own_view_with(1, torch.tensor([1, 2])).tolist() == [7, 8, 9, 10, 13, 1, 2]
        tokens.append(1, [3])  # the drafts written into the tail are overwritten by what is committed
        assert tokens.own_view(1).tolist() == [7, 8, 9, 10, 13, 3]


def test_the_mirror_grows_past_an_underestimated_capacity():
    tokens = _tokens(True)
    tokens.append(0, list(range(20, 40)))
    assert tokens.own_view(0).tolist() == [5, 6] + list(range(20, 40))


def test_sequences_are_right_padded_like_plain_generate():
    tokens = _tokens(False)
    tokens.append(0, [11, 12, 13])
    tokens.append(1, [14])
    assert tokens.sequences(pad_token_id=2, device=torch.device("cpu")).tolist() == [
        [0, 0, 5, 6, 11, 12, 13], [7, 8, 9, 10, 14, 2, 2]]
