"""Capture the target's aux hidden states and final (post-norm) hidden state: one forward per batch.

Aux id k (DESIGN section 2) = the input of decoder layer k = the output of layer k-1 (k=0: embeddings),
taken with forward hooks so only the wanted layers are kept; the final state is the output of the
target's final norm. The lm_head is never run: teacher logits are recomputed at train time.
"""
from __future__ import annotations

import hashlib
import json

import torch

from draftsmith.data.errors import UserError


def decoder_of(model):
    """The decoder stack (embed_tokens, layers, norm) of an HF causal LM."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for attr in ("embed_tokens", "layers", "norm"):
        if not hasattr(dec, attr):
            raise UserError(f"target decoder {type(dec).__name__} has no '{attr}'; capture supports Llama-like stacks")
    return dec


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_aux_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch [B, T] -> (aux [B, T, n_aux*H] ascending ids, final [B, T, H] after the final norm)."""
    dec = decoder_of(model)
    n = len(dec.layers)
    grabbed: dict[int, torch.Tensor] = {}

    def keep(layer_id):
        def hook(_module, _inputs, output):
            grabbed[layer_id] = _first(output)
        return hook

    handles = []
    for k in aux_layer_ids:
        # the residual stream after k layers: embeddings for k=0, else the output of layer k-1;
        # k=N is the last layer's output before the final norm
        module = dec.embed_tokens if k == 0 else dec.layers[k - 1]
        handles.append(module.register_forward_hook(keep(k)))
    handles.append(dec.norm.register_forward_hook(keep(n + 1)))
    try:
        dec(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[k] for k in aux_layer_ids], dim=-1)  # [B, T, n_aux * H]
    return aux, grabbed[n + 1]


def length_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group sample indices by similar length so that padded batch size stays under max_batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches, cur = [], []
    for i in order:
        if cur and lengths[cur[0]] * (len(cur) + 1) > max_batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (input_ids [B, T], attention_mask [B, T])."""
    t = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), t), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def capture_to_shards(model, samples: list[dict], aux_layer_ids: list[int], dataset_dir, split: str,
                      first_shard: int, samples_per_shard: int, max_batch_tokens: int, pad_id: int,
                      storage_dtype) -> list[dict]:
    """Capture `samples` ({"input_ids", "loss_mask"}) into shards first_shard, first_shard+1, ...

    Finished shards (sidecar present, checksum matching) are skipped, so a killed build resumes.
    """
    import time

    from tqdm import tqdm

    from draftsmith.data.shards import CapturedSample, finished_shard_entry, write_shard

    entries = []
    device = next(model.parameters()).device
    chunks = [samples[i: i + samples_per_shard] for i in range(0, len(samples), samples_per_shard)]
    bar = tqdm(total=sum(len(s["input_ids"]) for s in samples), desc=f"capture {split}", unit="tok", unit_scale=True)
    start, done_tokens = time.time(), 0
    for c, chunk in enumerate(chunks):
        index = first_shard + c
        inputs = hashlib.sha256(json.dumps([[s["input_ids"], s["loss_mask"]] for s in chunk]).encode()).hexdigest()
        entry = finished_shard_entry(dataset_dir, index, inputs)
        if entry is None:
            captured = [None] * len(chunk)
            for batch in length_batches([len(s["input_ids"]) for s in chunk], max_batch_tokens):
                ids, mask = pad_batch([chunk[i]["input_ids"] for i in batch], pad_id)
                aux, final = capture_aux_hidden_states(model, ids.to(device), mask.to(device), aux_layer_ids)
                aux, final = aux.cpu(), final.cpu()
                for row, i in enumerate(batch):
                    t = len(chunk[i]["input_ids"])
                    captured[i] = CapturedSample(ids[row, :t], torch.tensor(chunk[i]["loss_mask"]),
                                                 aux[row, :t].to(storage_dtype), final[row, :t].to(storage_dtype))
                done_tokens += int(mask.sum())
                bar.set_postfix(tok_s=f"{done_tokens / max(time.time() - start, 1e-6):.0f}")
            entry = write_shard(dataset_dir, index, split, captured, storage_dtype, inputs)
        entries.append(entry)
        bar.update(entry["num_tokens"])
    bar.close()
    return entries
