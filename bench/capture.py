"""Capture throughput vs a bare forward of the same batches, and bytes on disk per token (issue #2).

Usage: python bench/capture.py [--target smollm2] [--batches 6] [--batch 8] [--seq 256]
Prints, side by side from one run: tokens/s of the plain causal-LM forward, of the decoder-only forward,
of capture (hooks + copy + shard write), the overhead ratios, and bytes/token vs (n_aux+1)*H*2+16.
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data.capture import capture_to_shards, pad_batch
from draftsmith.data.layer_ids import default_aux_layer_ids
from draftsmith.data.target import load_target_model, resolve_target_path


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="float32", help="target compute dtype (the demo's on a CPU without bf16)")
    p.add_argument("--storage-dtype", default="bfloat16", help="dtype of the stored hidden states")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    model = load_target_model(resolve_target_path(a.target), a.dtype)
    cfg = model.config
    aux_ids = default_aux_layer_ids(cfg.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    lengths = [a.seq - (i * 7) % (a.seq // 4) for i in range(a.batches * a.batch)]
    seqs = [torch.randint(10, cfg.vocab_size, (t,), generator=g).tolist() for t in lengths]
    samples = [{"input_ids": s, "loss_mask": [1] * len(s)} for s in seqs]
    batches = [pad_batch(seqs[i: i + a.batch], 0) for i in range(0, len(seqs), a.batch)]
    tokens = sum(lengths)
    torch.set_grad_enabled(False)
    bare = timed(lambda: [model(input_ids=i, attention_mask=m) for i, m in batches], a.repeats)
    decoder = timed(lambda: [model.model(input_ids=i, attention_mask=m) for i, m in batches], a.repeats)
    with tempfile.TemporaryDirectory() as d:
        def capture():
            for f in Path(d).iterdir():
                f.unlink()
            return capture_to_shards(model, samples, aux_ids, Path(d), "train", 0, a.batch, a.batch * a.seq, 0,
                                     getattr(torch, a.storage_dtype))
        cap = timed(capture, a.repeats)
        disk = sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
    h, n_aux = cfg.hidden_size, len(aux_ids)
    goal = (n_aux + 1) * h * 2 + 16
    print(f"target {a.target} ({a.dtype}, stored as {a.storage_dtype}), {len(batches)} batches x {a.batch} x <= {a.seq} tokens = {tokens} tokens, "
          f"aux ids {aux_ids}, torch threads {torch.get_num_threads()}")
    print(f"{'run':34s} {'tokens/s':>10s} {'time vs bare':>13s}")
    for name, t in (("bare forward (causal LM, logits)", bare), ("decoder-only forward (no lm_head)", decoder),
                    ("capture (hooks + copy + shard)", cap)):
        print(f"{name:34s} {tokens / t:10.0f} {t / bare:12.3f}x")
    print(f"capture overhead vs bare forward: {100 * (cap / bare - 1):+.1f} %  (goal <= +10 %)")
    print(f"capture overhead vs decoder-only forward: {100 * (cap / decoder - 1):+.1f} %")
    print(f"bytes on disk per token: {disk / tokens:.1f}  (goal <= (n_aux+1)*H*2+16 = {goal})")


if __name__ == "__main__":
    main()
