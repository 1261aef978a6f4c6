"""Capture throughput vs a bare forward of the same batches, and bytes on disk per token (issue #2); peak
memory of a capture process vs the shard size (issue #11).

Usage: python bench/capture.py [--target smollm2] [--batches 6] [--batch 8] [--seq 256]
Prints, side by side from one run: tokens/s of the plain causal-LM forward, of the decoder-only forward,
of capture (hooks + copy + shard write), the overhead ratios, and bytes/token vs (n_aux+1)*H*2+16.

Usage: python bench/capture.py --peak-memory [--samples 1024] [--seq 256] [--shard-sizes 1024 64]
Captures the same samples on a seeded random Llama (hidden 256, 4 layers) in one fresh process per shard size
and prints each process's peak RSS: shards are streamed to disk, so it must not grow with the shard size. The
last row assembles the largest shard whole in memory, as capture did before streaming, for comparison.
"""
import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save

from draftsmith.data.capture import capture_aux_hidden_states, capture_to_shards, length_batches, pad_batch
from draftsmith.data.layer_ids import default_aux_layer_ids
from draftsmith.data.target import load_target_model, resolve_target_path


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


AUX_IDS = [1, 2, 3]  # of the random 4-layer target of --peak-memory


def random_target():
    """Peak memory depends on the captured widths (hidden 256, 3 aux layers), not on trained weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(cfg).eval()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def capture_shard_held_in_memory(model, samples: list[dict], out: Path, storage) -> None:
    """Capture as it was done before streaming: every sample of the shard kept, concatenated, serialised whole."""
    kept = [None] * len(samples)
    for batch in length_batches([len(s["input_ids"]) for s in samples], 8192):
        ids, mask = pad_batch([samples[i]["input_ids"] for i in batch], 0)
        aux, final = capture_aux_hidden_states(model, ids, mask, AUX_IDS)
        for row, i in enumerate(batch):
            t = len(samples[i]["input_ids"])
            kept[i] = (ids[row, :t], aux[row, :t].to(storage), final[row, :t].to(storage))
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    tensors = {"input_ids": torch.cat([k[0] for k in kept]).to(torch.int32),
               "loss_mask": torch.cat([torch.tensor(s["loss_mask"]) for s in samples]).to(torch.uint8),
               "aux_hidden_states": torch.cat([k[1] for k in kept]), "final_hidden_states": torch.cat([k[2] for k in kept]),
               "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])}
    (out / "shard-00000.safetensors").write_bytes(save(tensors))


def measure_capture_peak_rss(num_samples: int, seq: int, samples_per_shard: int, held_in_memory: bool) -> dict:
    """In a fresh process: peak RSS before capture (target + samples ready) and after capturing every sample."""
    model = random_target()
    g = torch.Generator().manual_seed(0)
    lengths = [seq - (i * 7) % (seq // 4) for i in range(num_samples)]
    samples = [{"input_ids": torch.randint(10, 1024, (t,), generator=g).tolist(), "loss_mask": [1] * t}
               for t in lengths]
    torch.set_grad_enabled(False)
    before = peak_rss_bytes()
    with tempfile.TemporaryDirectory() as d:
        if held_in_memory:
            capture_shard_held_in_memory(model, samples[:samples_per_shard], Path(d), torch.bfloat16)
        else:
            capture_to_shards(model, samples, AUX_IDS, Path(d), "train", 0, samples_per_shard, 8192, 0, torch.bfloat16)
        largest = max(f.stat().st_size for f in Path(d).glob("*.safetensors"))
    return {"peak_before": before, "peak": peak_rss_bytes(), "largest_shard": largest, "tokens": sum(lengths)}


def print_peak_memory(a) -> None:
    mib = 2**20
    print(f"peak RSS of one capture process: random Llama (hidden 256, 4 layers, aux ids {AUX_IDS}, fp32 forward), "
          f"{a.samples} samples of <= {a.seq} tokens stored as bf16, 8192 tokens per forward, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'samples/shard':>13s} {'path':>9s} {'largest shard':>14s} {'peak before':>12s} {'peak RSS':>9s} "
          f"{'capture adds':>13s}")
    runs = [(size, False) for size in a.shard_sizes] + [(max(a.shard_sizes), True)]
    for size, held in runs:
        cmd = [sys.executable, __file__, "--child", json.dumps([a.samples, a.seq, size, held])]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"{size:13d} {'in memory' if held else 'streamed':>9s} {r['largest_shard'] / mib:10.0f} MiB "
              f"{r['peak_before'] / mib:8.0f} MiB {r['peak'] / mib:5.0f} MiB {(r['peak'] - r['peak_before']) / mib:9.0f} MiB")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="float32", help="target compute dtype (the demo's on a CPU without bf16)")
    p.add_argument("--storage-dtype", default="bfloat16", help="dtype of the stored hidden states")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peak-memory", action="store_true", help="peak RSS of capture vs the shard size instead")
    p.add_argument("--samples", type=int, default=1024, help="--peak-memory: samples captured per process")
    p.add_argument("--shard-sizes", type=int, nargs="+", default=[1024, 64], help="--peak-memory: samples/shard")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one --peak-memory measurement, in its own process
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure_capture_peak_rss(*json.loads(a.child))))
        return
    if a.peak_memory:
        print_peak_memory(a)
        return
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
