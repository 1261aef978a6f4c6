"""Online training (data.capture online): the shards hold tokens only and the frozen target computes each row's
aux and final hidden states when the row is read, so nothing but the source of the hidden states differs from
offline training (same packing, same loss code).

Each process holds its own copy of the target, in target.dtype, in eval mode, without gradients, outside the
drafter module: it never enters the optimizer, the gradient all-reduce, the checkpoints or best/.
"""
from __future__ import annotations

import logging

import torch

from draftsmith.data.capture import capture_aux_hidden_states, input_device, length_batches, pad_batch
from draftsmith.data.shards import ShardedDataset

logger = logging.getLogger(__name__)


class OnlineHiddenStates(ShardedDataset):
    """A tokens-only dataset whose samples get the target's hidden states computed when they are read.

    The samples of a row are run in length-sorted, right-padded batches of at most `max_batch_tokens` padded
    tokens, as data/build.py captures them offline; a sample's states do not depend on the others in its batch
    (causal attention, padding on the right) beyond floating-point summation order.
    """

    def __init__(self, dataset_dir, split: str, target, aux_layer_ids: list[int], max_batch_tokens: int,
                 pad_id: int = 0):
        super().__init__(dataset_dir, split)
        self.target, self.aux_layer_ids = target, list(aux_layer_ids)
        self.max_batch_tokens, self.pad_id = max_batch_tokens, pad_id

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.read_samples([i])[0]

    @torch.no_grad()
    def read_samples(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        samples = [super(OnlineHiddenStates, self).__getitem__(i) for i in indices]
        device = input_device(self.target)
        for batch in length_batches([len(s["input_ids"]) for s in samples], self.max_batch_tokens):
            ids, mask = pad_batch([samples[i]["input_ids"].tolist() for i in batch], self.pad_id)
            aux, final = capture_aux_hidden_states(self.target, ids.to(device), mask.to(device), self.aux_layer_ids)
            for row, i in enumerate(batch):
                t = len(samples[i]["input_ids"])
                samples[i]["aux_hidden_states"] = aux[row, :t].cpu()
                samples[i]["final_hidden_states"] = final[row, :t].cpu()
        return samples


def online_datasets(train_ds: ShardedDataset, heldout_ds: ShardedDataset, target, aux_layer_ids: list[int],
                    max_batch_tokens: int) -> tuple[OnlineHiddenStates, OnlineHiddenStates]:
    """The train and held-out splits of a tokens-only dataset, read through the target."""
    logger.info("online training: the target computes aux layers %s for every row (no hidden states on disk)",
                aux_layer_ids)
    return (OnlineHiddenStates(train_ds.dir, "train", target, aux_layer_ids, max_batch_tokens),
            OnlineHiddenStates(heldout_ds.dir, "heldout", target, aux_layer_ids, max_batch_tokens))
