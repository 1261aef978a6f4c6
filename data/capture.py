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
from draftsmith.data.shards import CapturedSample, ShardWriter, finished_shard_entry, written_shard_entry


def decoder_of(model):
    """The decoder stack (embed_tokens, layers, norm) of an HF causal LM."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for attr in ("embed_tokens", "layers", "norm"):
        if not hasattr(dec, attr):
            raise UserError(f"target decoder {type(dec).__name__} has no '{attr}'; capture supports Llama-like stacks")
    return dec


def input_device(model) -> torch.device:
    """Where the target's inputs go: the device of its input embedding. Under a device_map the first parameter
    can sit elsewhere (another GPU, or the CPU for an offloaded part), so next(parameters()) is not it."""
    embed = decoder_of(model).embed_tokens
    # an embedding accelerate offloaded (weights on "meta") runs on its hook's execution device
    device = getattr(getattr(embed, "_hf_hook", None), "execution_device", None)
    return torch.device(device) if device is not None else embed.weight.device


def hidden_size_of(model) -> int:
    return decoder_of(model).embed_tokens.embedding_dim


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
    # under a device_map the layers sit on several GPUs: gather the taps where the inputs are
    aux = torch.cat([grabbed[k].to(input_ids.device) for k in aux_layer_ids], dim=-1)  # [B, T, n_aux * H]
    return aux, grabbed[n + 1].to(input_ids.device)


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


def plan_shards(samples: list[dict], samples_per_shard: int) -> list[list[dict]]:
    """The samples of shard 0, 1, ... of one split, in order (the same plan for every process count)."""
    return [samples[i: i + samples_per_shard] for i in range(0, len(samples), samples_per_shard)]


def shard_inputs_sha256(chunk: list[dict], tokens_only: bool = False) -> str:
    """What a shard is made from: a resumed build recaptures a shard whose samples changed, and never takes a
    tokens-only shard (data.capture online) for a captured one or the other way round."""
    content = [[s["input_ids"], s["loss_mask"]] for s in chunk] + (["tokens only"] if tokens_only else [])
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()


def capture_shard(model, chunk: list[dict], aux_layer_ids: list[int], writer, max_batch_tokens: int, pad_id: int,
                  bar) -> None:
    """Capture one shard's samples batch by batch, each sample written to its place as soon as it is captured."""
    device = input_device(model)
    for batch in length_batches([len(s["input_ids"]) for s in chunk], max_batch_tokens):
        ids, mask = pad_batch([chunk[i]["input_ids"] for i in batch], pad_id)
        aux, final = capture_aux_hidden_states(model, ids.to(device), mask.to(device), aux_layer_ids)
        aux, final = aux.cpu(), final.cpu()
        for row, i in enumerate(batch):
            t = len(chunk[i]["input_ids"])
            writer.write_sample(i, CapturedSample(ids[row, :t], torch.tensor(chunk[i]["loss_mask"]), aux[row, :t],
                                                  final[row, :t]))
        bar.update(int(mask.sum()))


def write_tokens_only(chunk: list[dict], writer, bar) -> None:
    """data.capture online: a shard of tokens and loss masks, its hidden-state tensors zero columns wide."""
    for i, s in enumerate(chunk):
        t = len(s["input_ids"])
        writer.write_sample(i, CapturedSample(torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]),
                                              torch.empty(t, 0), torch.empty(t, 0)))
        bar.update(t)


def capture_to_shards(model, samples: list[dict], aux_layer_ids: list[int], dataset_dir, split: str,
                      first_shard: int, samples_per_shard: int, max_batch_tokens: int, pad_id: int,
                      storage_dtype, rank: int = 0, world_size: int = 1) -> list[dict]:
    """Capture `samples` ({"input_ids", "loss_mask"}) into shards first_shard, first_shard+1, ...; of N processes,
    process r captures the shards whose index is r modulo N. Returns the manifest entries of this process's shards.

    Finished shards (sidecar present, checksum matching) are skipped, so a killed build resumes. model None
    (data.capture online) writes the tokens alone: training computes the hidden states.
    """
    from tqdm import tqdm

    shards = [(first_shard + c, chunk) for c, chunk in enumerate(plan_shards(samples, samples_per_shard))
              if (first_shard + c) % world_size == rank]
    hidden = 0 if model is None else hidden_size_of(model)
    entries = []
    with tqdm(total=sum(len(s["input_ids"]) for _, chunk in shards for s in chunk), desc=f"capture {split}",
              unit="tok", unit_scale=True, disable=rank != 0) as bar:
        for index, chunk in shards:
            inputs = shard_inputs_sha256(chunk, tokens_only=model is None)
            entry = finished_shard_entry(dataset_dir, index, inputs)
            if entry is None:
                with ShardWriter(dataset_dir, index, split, [len(s["input_ids"]) for s in chunk],
                                 len(aux_layer_ids) * hidden, hidden, storage_dtype, inputs) as writer:
                    if model is None:
                        write_tokens_only(chunk, writer, bar)
                    else:
                        capture_shard(model, chunk, aux_layer_ids, writer, max_batch_tokens, pad_id, bar)
                    entry = writer.finish()
            else:
                bar.update(entry["num_tokens"])
            entries.append(entry)
    return entries


def capture_splits(model, samples: dict[str, list[dict]], aux_layer_ids: list[int], dataset_dir,
                   samples_per_shard: int, max_batch_tokens: int, pad_id: int, storage_dtype, rank: int = 0,
                   world_size: int = 1) -> None:
    """This process's shards of a dataset's one plan: train shards first, held-out shards numbered on after them."""
    first = 0
    for split in ("train", "heldout"):
        capture_to_shards(model, samples[split], aux_layer_ids, dataset_dir, split, first, samples_per_shard,
                          max_batch_tokens, pad_id, storage_dtype, rank, world_size)
        first += len(plan_shards(samples[split], samples_per_shard))


def planned_shard_entries(dataset_dir, samples: dict[str, list[dict]], samples_per_shard: int,
                          tokens_only: bool = False) -> list[dict]:
    """Every shard's manifest entry in plan order, from the sidecars the capturing processes wrote."""
    entries = []
    for split in ("train", "heldout"):
        for chunk in plan_shards(samples[split], samples_per_shard):
            entries.append(written_shard_entry(dataset_dir, len(entries), shard_inputs_sha256(chunk, tokens_only)))
    return entries
