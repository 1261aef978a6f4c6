"""Draft vocab from loss-masked counts: top-V_d, ascending, d2t offsets, t2d mask."""
import torch

from draftsmith.data.vocab import build_draft_vocab, count_loss_masked_tokens, draft_to_target_ids


def test_counts_only_loss_masked_tokens():
    ids = torch.tensor([1, 2, 2, 3, 3, 3])
    mask = torch.tensor([0, 1, 1, 0, 1, 1])
    assert count_loss_masked_tokens(ids, mask, 5).tolist() == [0, 0, 2, 2, 0]


def test_top_tokens_sorted_with_offsets_brute_force():
    counts = torch.tensor([0, 5, 1, 9, 5, 0, 7, 2])
    d2t, t2d = build_draft_vocab(counts, 4)
    # brute force: sort by (-count, id), take 4, sort ascending
    expected = sorted(sorted(range(8), key=lambda i: (-counts[i].item(), i))[:4])
    assert expected == [1, 3, 4, 6]
    assert draft_to_target_ids(d2t).tolist() == expected
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1 - 0, 3 - 1, 4 - 2, 6 - 3]
    assert t2d.tolist() == [i in expected for i in range(8)]


def test_unseen_ids_fill_up_and_size_clips_to_vocab():
    d2t, t2d = build_draft_vocab(torch.tensor([0, 0, 3, 0]), 3)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2]
    d2t, t2d = build_draft_vocab(torch.tensor([1, 2]), 32000)
    assert len(d2t) == 2 and t2d.all()
