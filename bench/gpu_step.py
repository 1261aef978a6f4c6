"""One EAGLE-3 training step on a GPU, ours and speculators 0.9's, side by side in one run (issue #12, item 4).

Usage: python bench/gpu_step.py [--targets smollm2=CONFIG.json llama3.1-8b=CONFIG.json] [--seq 8192]
       [--ttt-steps 7] [--draft-vocab 32000] [--warmup 3] [--steps 10] [--speculators-site DIR] [--work DIR]
The step is the training loop's: forward under bf16 autocast, backward, grad clip, the optimizers and the schedule,
one host sync for the loss. Ours runs train/eagle3.py's ttt_row_loss with the compiled flex attention and speculators'
recipe (bench/speculators_recipe.py: Muon, its norms, the target's head frozen); speculators' runs its own
Eagle3DraftModel (forward compiled, flex attention, fused loss, Muon + AdamW as its Trainer builds them). Both load
one head-only target folder that this script writes per target: the target's config.json and seeded random
embed_tokens / lm_head / final norm, through each trainer's own loading code. Each row is 8192 tokens of documents
shaped like the anchor's conversations (150-360 tokens, the first 28 % prompt, unscored), with random hidden states.

Each (target, trainer) runs in a fresh process: peak memory is per process (torch.cuda.max_memory_allocated over the
timed steps). Tokens/s counts every token of the rows. MFU divides the step's model FLOPs (model_flops(): every
matmul of the layer at all positions, the draft head and the teacher at the scored positions, backward as 2x the
forward of whatever needs a gradient) by the measured step time and H200's dense bf16 peak (989 TFLOP/s, datasheet):
both trainers get the same numerator, so their MFU ratio is their speed ratio.

speculators needs pydantic and loguru, which the GPU image may lack: pass --speculators-site, a folder of installed
wheels put on that worker's sys.path only. Its data pipeline imports (openai, datasets) are not used by the step;
where they fail to import they are replaced by empty modules, and the report says so.
"""
import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
H200_BF16_PEAK = 989.4e12  # dense bf16 FLOP/s, NVIDIA's H200 SXM datasheet
DOC_LENGTHS = (150, 360)  # the anchor conversations' token counts lie in about this range (mean 268)
PROMPT_FRACTION = 0.28  # the anchor's prompt share (its responses are 72 % of the tokens)
SEQUENCE = ["draftsmith", "speculators"]


def synthetic_documents(seq: int, seed: int = 0) -> list[int]:
    """Document lengths filling exactly seq tokens, seeded: the same row for both trainers."""
    import random

    rng, lengths = random.Random(seed), []
    while sum(lengths) < seq:
        lengths.append(rng.randint(*DOC_LENGTHS))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def synthetic_row(seq: int, hidden: int, vocab: int, num_aux: int, device, seed: int = 0) -> dict:
    """The row in our layout: documents back to back, prompts unscored, bf16 states as the dataset stores them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = synthetic_documents(seq, seed)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    loss_mask = torch.cat([(torch.arange(n) >= round(PROMPT_FRACTION * n)).long() for n in lengths])[None]
    row = {"input_ids": torch.randint(0, vocab, (1, seq), generator=g), "loss_mask": loss_mask,
           "aux_hidden_states": torch.randn(1, seq, num_aux * hidden, generator=g).bfloat16(),
           "final_hidden_states": torch.randn(1, seq, hidden, generator=g).bfloat16(),
           "position_ids": position_ids, "document_ids": document_ids}
    row = {k: v.to(device) for k, v in row.items()}
    return row | {"row_seed": seed, "num_tokens": seq}


def write_head_only_target(config_path: Path, out: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors holding only embed_tokens, lm_head (unless tied) and the final norm."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads(config_path.read_text())
    if (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    tensors = {"model.embed_tokens.weight": (0.02 * torch.randn(V, H, generator=g)).bfloat16(),
               "model.norm.weight": (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = (0.02 * torch.randn(V, H, generator=g)).bfloat16()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def vocab_maps(vocab: int, draft_vocab: int):
    """(t2d, d2t) marking the first draft_vocab target ids: data/vocab.py's choice when no token was counted."""
    import torch

    from draftsmith.data.vocab import build_draft_vocab

    d2t, t2d = build_draft_vocab(torch.zeros(vocab, dtype=torch.int64), draft_vocab)
    return t2d, d2t


def ttt_attention_pairs(lengths: list[int], step: int) -> int:
    """(query, key) pairs TTT step `step` attends: step-0 keys s <= t of t's document, plus t's own keys of steps
    1..step (train/ttt.py TTTAttention)."""
    return sum(n * (n + 1) // 2 for n in lengths) + step * sum(lengths)


def model_flops(cfg: dict, lengths: list[int], scored_per_step: list[int], draft_vocab: int,
                head_trainable: bool) -> float:
    """FLOPs one training step needs (see the module docstring); cfg is the target's config.json."""
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or H // heads
    T, J = sum(lengths), len(scored_per_step)
    layer = 2 * T * (2 * H * (heads + 2 * kv_heads) * d + heads * d * H + 3 * H * inter)  # qkv from [emb|h], o, MLP
    attention = sum(4 * heads * d * ttt_attention_pairs(lengths, j) for j in range(J))
    head = sum(2 * s * H * draft_vocab for s in scored_per_step)
    teacher = 2 * scored_per_step[0] * H * draft_vocab
    fc = 2 * T * 3 * H * H
    return 3 * (J * layer + attention) + 2 * fc + (3 if head_trainable else 2) * head + teacher


def scored_positions_per_step(seq: int, ttt_steps: int) -> list[int]:
    """Positions each TTT step scores in the synthetic row (train/ttt.py's shifted masks), counted on the CPU."""
    import torch

    from draftsmith.train.ttt import shift_for_ttt, ttt_step_masks

    row = synthetic_row(seq, 1, 1, 1, torch.device("cpu"))
    _, _, mask = shift_for_ttt(row["input_ids"], row["final_hidden_states"], row["loss_mask"], row["document_ids"])
    return ttt_step_masks(mask, row["document_ids"], ttt_steps).sum(dim=(1, 2)).tolist()


def profile_steps(step, device, steps: int = 2, top: int = 30) -> str:
    """torch.profiler over `steps` more steps: kernel count per step, device and host time, and the kernels (or,
    on a CPU, the operators) with the most self time; where a step loses its time, not how long it takes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
        launches = sum(e.count for e in kernels) / steps
        head = (f"per step under the profiler: wall {1e3 * wall:.1f} ms, GPU kernels busy {1e3 * busy:.1f} ms "
                f"({busy / wall:.0%}), {launches:.0f} kernel launches")
        table = events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70)
    else:
        head = f"per step under the profiler: wall {1e3 * wall:.1f} ms (CPU)"
        table = events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70)
    return head + "\n" + table


def write_profile(path: Path, step, device) -> None:
    """The profile, or why it failed (the profiler's API is untested on a GPU here): never the timings' end."""
    try:
        text = profile_steps(step, device)
    except Exception as e:  # noqa: BLE001 (any profiler failure: the timed result is already measured)
        text = f"profile failed: {type(e).__name__}: {e}"
    path.write_text(text)


def time_steps(step, warmup: int, steps: int, device) -> dict:
    """Warm-up steps (compilation) untimed, then `steps` timed ones; peak memory over the timed steps (on a CPU,
    where this runs only as a smoke test, the process's peak RSS)."""
    import resource

    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())  # each step ends on a host sync (the loss), as both trainers log it
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"warmup_s": warmup_s, "step_s": times, "losses": losses, "peak_allocated_gib": peak / 2**30,
            "peak_reserved_gib": (torch.cuda.max_memory_reserved() if cuda else peak) / 2**30}


def draftsmith_worker(a) -> dict:
    import torch
    from speculators_recipe import SPECULATORS_RECIPE

    from draftsmith.data.config import load_config
    from draftsmith.data.layer_ids import default_aux_layer_ids
    from draftsmith.data.target import load_target_config, load_target_head
    from draftsmith.train.drafter import Drafter, init_drafter_from_target, init_head_from_target
    from draftsmith.train.eagle3 import ttt_row_loss
    from draftsmith.train.loop import build_optimizer
    from draftsmith.train.objective import DrafterObjective
    from draftsmith.train.spec import spec_for_target

    device = torch.device(a.device)
    cfg, _ = load_config("smollm2-demo", [*SPECULATORS_RECIPE, f"ttt.num_steps={a.ttt_steps}",
                                          f"train.batch_tokens={a.seq}"])
    hf = load_target_config(str(a.target_dir))
    aux_ids = default_aux_layer_ids(hf.num_hidden_layers)
    spec = spec_for_target(hf, cfg.drafter, method="eagle3", aux_layer_ids=aux_ids, draft_vocab_size=a.draft_vocab)
    torch.manual_seed(0)
    drafter = Drafter(spec)
    head = load_target_head(str(a.target_dir))
    t2d, d2t = vocab_maps(hf.vocab_size, a.draft_vocab)
    with torch.no_grad():
        init_drafter_from_target(drafter, head["embed"].float(), d2t, t2d)
        init_head_from_target(drafter, head["lm_head"].float(), head["norm"].float())
    drafter.lm_head.weight.requires_grad_(not cfg.train.freeze_lm_head)
    teacher_weight = head["lm_head"].float().to(device)
    t2d_dev = t2d.to(device)
    impl = {"impl": a.attention}

    def row_loss(model, row):
        return ttt_row_loss(model, row, teacher_weight, t2d_dev, cfg, impl["impl"])

    model = DrafterObjective(drafter, row_loss).to(device)
    opt, sched = build_optimizer(model, cfg.train, "bf16")
    row = synthetic_row(a.seq, hf.hidden_size, hf.vocab_size, len(aux_ids), device)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():  # train/loop.py Trainer.train_step for one process, grad_accum 1
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, metrics = model(row)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        metrics["correct"].cpu()
        return float(loss.detach())

    result = time_steps(step, a.warmup, a.steps, device)
    if a.profile_out:
        write_profile(a.profile_out, step, device)
    # the compiled flex kernel against the plain-PyTorch one on this device: the loss of the same weights and row
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        losses = {}
        for name in ("flex", "blockwise"):
            impl["impl"] = name
            loss, metrics = model(row)
            losses[name] = (float(loss), metrics["correct"].tolist())
    return result | {"trainable_params": sum(p.numel() for p in params), "attention": a.attention,
                     "flex_vs_blockwise": losses,
                     "optimizer": type(opt).__name__, "overrides": SPECULATORS_RECIPE}


def import_speculators_model():
    """speculators' Eagle3 model; its data pipeline's imports replaced by empty modules where missing."""
    import importlib.abc
    import importlib.util
    import types

    stubbed = []

    class MissingAsEmpty(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        roots = ("openai", "datasets")

        def find_spec(self, name, path, target=None):
            root = name.split(".")[0]
            if root not in self.roots:
                return None
            if root not in stubbed:  # the first import of the root: is the real one importable?
                sys.meta_path.remove(self)
                try:
                    if importlib.util.find_spec(root) is not None:
                        self.roots = tuple(r for r in self.roots if r != root)
                        return None
                finally:
                    sys.meta_path.insert(0, self)
                stubbed.append(root)
            return importlib.util.spec_from_loader(name, self, is_package=True)

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = stub_attribute  # annotations and base classes only
            module.__file__ = None  # a namespace-like module (dynamo's inspect asks for it)
            return module

        def exec_module(self, module):
            pass

    def stub_attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    sys.meta_path.insert(0, MissingAsEmpty())
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.optimizers import build_optimizers

    return Eagle3DraftModel, create_transformer_layer_config, build_optimizers, resolve_loss_config, stubbed


def speculators_worker(a) -> dict:
    import torch

    from draftsmith.data.layer_ids import default_aux_layer_ids

    Eagle3DraftModel, layer_config, build_optimizers, resolve_loss_config, stubbed = import_speculators_model()
    device = torch.device(a.device)
    target = str(a.target_dir)
    hf = json.loads((a.target_dir / "config.json").read_text())
    num_layers = hf["num_hidden_layers"]
    aux_ids = default_aux_layer_ids(num_layers)  # vLLM's default, which speculators' resolve_target_layer_ids shares
    tl_config = layer_config(target, num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=None,
                             full_attention_indices=[0])
    t2d, d2t = vocab_maps(hf["vocab_size"], a.draft_vocab)
    torch.manual_seed(0)
    # `speculators train` defaults for eagle3: norm_before_fc / norm_output / norm_before_residual on
    model = Eagle3DraftModel.from_training_args(
        verifier_config=tl_config, t2d=t2d, d2t=d2t, verifier_name_or_path=target, draft_vocab_size=a.draft_vocab,
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=a.ttt_steps,
        target_layer_ids=aux_ids, draft_attn_impl=a.speculators_attention).to(device)
    trainer_defaults = argparse.Namespace(  # its TrainerConfig defaults, lr as in the anchor recipe
        optimizer="muon", lr=2e-3, weight_decay=0.01, muon_lr=2e-3, muon_momentum=0.95, muon_weight_decay=0.1,
        muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")
    optimizers = build_optimizers(model, trainer_defaults)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 8)) for o in optimizers]
    ours = synthetic_row(a.seq, hf["hidden_size"], hf["vocab_size"], len(aux_ids), device)
    # its collate's layout: documents marked by document_ids, positions from 1 (its per-sample shift pairs x[t+1],
    # g[t], y[t+1], l[t+1]; the states are random here, so which pairs it sees changes nothing timed)
    batch = {"hidden_states": ours["aux_hidden_states"], "input_ids": ours["input_ids"],
             "verifier_last_hidden_states": ours["final_hidden_states"], "loss_mask": ours["loss_mask"],
             "position_ids": ours["position_ids"] + 1, "document_ids": ours["document_ids"]}
    loss_config = resolve_loss_config("kl_div", a.speculators_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()

    def step():  # speculators.train.trainer.Trainer.train_epoch's body
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss, _metrics = model(**batch, ttt_steps=a.ttt_steps, ttt_step_loss_decay=1.0,
                                      loss_config=loss_config)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
        return float(loss.detach())

    result = time_steps(step, a.warmup, a.steps, device)
    if a.profile_out:
        write_profile(a.profile_out, step, device)
    return result | {"trainable_params": sum(p.numel() for p in params),
                     "speculators": importlib.metadata.version("speculators"),
                     "attention": a.speculators_attention, "loss_implementation": a.speculators_loss,
                     "stubbed_imports": stubbed, "optimizer": [type(o).__name__ for o in optimizers]}


def worker(a) -> None:
    import torch

    t0 = time.perf_counter()
    result = (draftsmith_worker if a.worker == "draftsmith" else speculators_worker)(a)
    result |= {"process_s": time.perf_counter() - t0, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "seq": a.seq,
               "ttt_steps": a.ttt_steps}
    a.result.write_text(json.dumps(result, indent=1))


def run_worker(side: str, name: str, target_dir: Path, a, timeout_s: float) -> dict:
    """One (target, trainer) in a fresh process; its log beside the result."""
    result_path = a.work / f"{name}-{side}.json"
    log_path = a.work / f"{name}-{side}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--worker", side, "--target-dir", str(target_dir), "--result", str(result_path),
           "--seq", str(a.seq), "--ttt-steps", str(a.ttt_steps), "--draft-vocab", str(a.draft_vocab),
           "--warmup", str(a.warmup), "--steps", str(a.steps), "--attention", a.attention,
           "--speculators-attention", a.speculators_attention, "--speculators-loss", a.speculators_loss,
           "--device", a.device]
    if a.profile:
        cmd += ["--profile-out", str(a.work / f"{name}-{side}-profile.txt")]
    env = dict(os.environ)
    if side == "speculators" and a.speculators_site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(a.speculators_site), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                check=False).returncode
    except subprocess.TimeoutExpired:
        rc = f"timed out after {timeout_s:.0f} s"
    if rc == 0 and result_path.is_file():
        return json.loads(result_path.read_text())
    tail = log_path.read_text(errors="replace").splitlines()[-25:]
    return {"error": f"exit {rc} after {time.perf_counter() - t0:.0f} s", "log_tail": tail}


def report(name: str, config: dict, results: dict, a) -> list[str]:
    heads = f"{config['num_attention_heads']}/{config.get('num_key_value_heads')}"
    lines = [(f"target {name}: H={config['hidden_size']}, intermediate {config['intermediate_size']}, {heads} heads, "
              f"vocab {config['vocab_size']}; rows of {a.seq} tokens, {a.ttt_steps} TTT steps, draft vocab "
              f"{a.draft_vocab}, bf16 autocast")]
    scored = scored_positions_per_step(a.seq, a.ttt_steps)
    flops = model_flops(config, synthetic_documents(a.seq), scored, a.draft_vocab, head_trainable=False)
    lines.append(f"  model FLOPs per step {flops / 1e12:.2f} T (frozen draft head in both; scored positions per "
                 f"step {scored})")
    speed = {}
    for side in SEQUENCE:
        r = results.get(side, {})
        if "error" in r or not r:
            lines.append(f"  {side:11s} FAILED: {r.get('error', 'not run')}")
            lines += [f"    | {t}" for t in r.get("log_tail", [])]
            continue
        step_s = sorted(r["step_s"])[len(r["step_s"]) // 2]
        speed[side] = a.seq / step_s
        mfu = f"{flops / step_s / H200_BF16_PEAK:.1%}" if "H200" in r["gpu"] else "n/a"
        lines.append(f"  {side:11s} {speed[side]:9.0f} tokens/s (median of {len(r['step_s'])} steps: "
                     f"{1e3 * step_s:.1f} ms)  peak {r['peak_allocated_gib']:.2f} GiB allocated / "
                     f"{r['peak_reserved_gib']:.2f} reserved  MFU {mfu}  warm-up+compile {r['warmup_s']:.0f} s  "
                     f"trainable {r['trainable_params'] / 1e6:.1f}M  loss {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f}")
        lines.append(f"    {r['gpu']}, torch {r['torch']}, process {r['process_s']:.0f} s"
                     + (f", result from {r['from']}" if "from" in r else ""))
        if side == "draftsmith":
            fb = r["flex_vs_blockwise"]
            lines.append(f"    flex vs blockwise on this device (same weights and row, eval): loss "
                         f"{fb['flex'][0]:.5f} vs {fb['blockwise'][0]:.5f}, top-1 hits {fb['flex'][1]} vs "
                         f"{fb['blockwise'][1]}")
        else:
            lines.append(f"    speculators {r['speculators']}, attention {r['attention']}, loss "
                         f"{r['loss_implementation']}, optimizers {r['optimizer']}"
                         + (f", empty modules for {r['stubbed_imports']} (its data pipeline's; not installed here)"
                            if r["stubbed_imports"] else ""))
    if len(speed) == 2:
        o, s = results["draftsmith"], results["speculators"]
        lines.append(f"  ratio draftsmith / speculators: tokens/s {speed['draftsmith'] / speed['speculators']:.2f}x, "
                     f"peak allocated memory {o['peak_allocated_gib'] / s['peak_allocated_gib']:.2f}x")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=[],
                   help="NAME=CONFIG.json pairs (default: the embedded SmolLM2 target's config)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--attention", default="flex", help="ours: flex (compiled on CUDA) or blockwise")
    p.add_argument("--speculators-attention", default="simple_flex_attention")
    # speculators' default is its fused Triton loss; inside its compiled forward on the H200 image's torch 2.11 dynamo
    # stops on it ("ListVariable ... is already tracked for mutation": the two kernels' autotune config lists), so
    # the eager loss, its other supported implementation, is the default here
    p.add_argument("--speculators-loss", default="eager", choices=("fused", "eager"))
    p.add_argument("--speculators-site", type=Path, help="installed wheels for the speculators worker only")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of both workers (blockwise / sdpa + eager)")
    p.add_argument("--sides", nargs="+", default=SEQUENCE, choices=SEQUENCE)
    p.add_argument("--timeout", type=float, default=240, help="seconds per (target, trainer) process")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds for the whole run; later processes get less")
    p.add_argument("--work", type=Path, default=Path("/tmp/draftsmith-gpu-step"))
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile 2 more into <work>/<target>-<trainer>-profile.txt")
    p.add_argument("--report-from", nargs="+", type=Path, metavar="WORK_DIR",
                   help="print the report of earlier runs' <target>-<trainer>.json (a later folder's result wins)")
    p.add_argument("--worker", choices=SEQUENCE, help=argparse.SUPPRESS)
    p.add_argument("--target-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--profile-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return
    start = time.perf_counter()
    bad = [t for t in a.targets if "=" not in t]
    if bad:
        sys.exit(f"--targets takes NAME=CONFIG.json pairs, got {bad}")
    targets = [t.split("=", 1) for t in a.targets]
    if not targets:
        from draftsmith.data.target import resolve_target_path

        targets = [("smollm2", str(Path(resolve_target_path("smollm2")) / "config.json"))]
    print(f"$ python bench/gpu_step.py {' '.join(sys.argv[1:])}", flush=True)
    if a.report_from:
        for name, config_path in targets:
            results = {}
            for folder in a.report_from:
                for side in SEQUENCE:
                    if (folder / f"{name}-{side}.json").is_file():
                        results[side] = json.loads((folder / f"{name}-{side}.json").read_text()) | {
                            "from": str(folder)}
            print("\n".join(report(name, json.loads(Path(config_path).read_text()), results, a)))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    for name, config_path in targets:
        config = json.loads(Path(config_path).read_text())
        target_dir = write_head_only_target(Path(config_path), a.work / "targets" / name)
        results = {}
        for side in a.sides:
            left = a.deadline - (time.perf_counter() - start)
            if left < 30:
                results[side] = {"error": "no time left in --deadline"}
                continue
            results[side] = run_worker(side, name, target_dir, a, min(a.timeout, left))
        (a.work / f"{name}-results.json").write_text(json.dumps(results, indent=1))
        print("\n".join(report(name, config, results, a)), flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
