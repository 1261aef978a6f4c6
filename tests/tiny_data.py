"""The tiny dataset of the tests: token streams with learnable structure, captured from the tiny random target
(tests/conftest.py builds the target) or, online, its tokens alone."""
import random

import torch
from transformers import AutoModelForCausalLM

from draftsmith.data.capture import capture_to_shards
from draftsmith.data.manifest import atomic_write_json, target_identity
from draftsmith.data.shards import FORMAT
from draftsmith.data.vocab import build_draft_vocab, count_loss_masked_tokens, save_vocab

TINY_VOCAB = 96


def _periodic_samples(n: int, seed: int) -> list[dict]:
    """Token streams with learnable structure (repeating motifs), half of each masked for loss."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 7))]
        t = rng.randrange(24, 60)
        ids = [1] + [motif[i % len(motif)] for i in range(t - 1)]
        out.append({"input_ids": ids, "loss_mask": [0] * (t // 3) + [1] * (t - t // 3)})
    return out


def build_tiny_dataset(target_dir, out_dir, num_train=48, num_heldout=8, draft_vocab=48, aux_ids=(1, 2, 3),
                       online=False):
    """The tiny dataset, captured (float32 storage) or, online, its tokens alone (data.capture online)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    shards, first = [], 0
    samples = {"train": _periodic_samples(num_train, 0), "heldout": _periodic_samples(num_heldout, 1)}
    for split in ("train", "heldout"):
        entries = capture_to_shards(None if online else model, samples[split], list(aux_ids), out_dir, split, first,
                                    16, 4096, 0, torch.float32)
        shards += entries
        first += len(entries)
    counts = sum(count_loss_masked_tokens(torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), TINY_VOCAB)
                 for s in samples["train"])
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    save_vocab(out_dir / "vocab.safetensors", d2t, t2d, counts)
    atomic_write_json(out_dir / "manifest.json", {
        "format": FORMAT, "target": target_identity(str(target_dir), model.config), "aux_layer_ids": list(aux_ids),
        "dtype": "float32", "capture": "online" if online else "offline", "num_samples": sum(s["num_samples"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards), "shards": shards})
