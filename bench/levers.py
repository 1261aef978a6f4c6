"""Quality levers of the EAGLE-3 recipe at equal data and budget (issue #12, item 3), scored on held-out data.

Usage: .venv/bin/python bench/levers.py [--budget 120000] [--only base muon ...] [--serve]
Every variant trains the anchor recipe of bench/vs_speculators.py (1 layer, 3 TTT steps, draft vocab 32000,
2048-token rows, lr 2e-3, 8 warm-up steps, SmolLM2 target) on the same dataset (the first anchor conversations
for the budget, built once by data/build.py) for the same number of steps, changing one thing; the figure is the
held-out simulated acceptance length at K=3 from the trainer's final evaluation on the whole held-out split (the
training-family conversations). With --serve, each variant is also exported and served by vLLM at K=3 on
bench/vs_speculators.py's held-out prompts of another family (HumanEval), beside the target alone, as that bench
serves: the served acceptance length per variant, side by side in one run.
"""
import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import speculators_side
import vs_speculators
from speculators_recipe import SPECULATORS_NORMS, SPECULATORS_RECIPE

from draftsmith.data.run_paths import RunPaths

VARIANTS = {
    "base": [],
    "step_weight=1.0": ["ttt.step_weight=1.0"],
    "speculators norms": SPECULATORS_NORMS,
    "EAGLE-3.1 norms": ["drafter.fc_norm=true", "drafter.norm_output=true"],
    "muon": ["train.optimizer=muon"],  # muon_lr = lr, as speculators sets it
    "lr=5e-3": ["train.lr=5e-3"],
    "hidden noise 0.05": ["train.hidden_noise_std=0.05"],
    "head from target": ["train.lm_head_init=target"],
    "frozen target head": ["train.lm_head_init=target", "train.freeze_lm_head=true"],
}
# speculators' own recipe on our trainer (results-vs-speculators-recipes-cpu.txt, "B"), then B less one part or plus
# one lever: which parts of B carry its served gain, and what goes beyond it
VARIANTS |= {
    "speculators recipe": SPECULATORS_RECIPE,
    "recipe - muon": [o for o in SPECULATORS_RECIPE if o != "train.optimizer=muon"],
    "recipe - norms": [o for o in SPECULATORS_RECIPE if o not in SPECULATORS_NORMS],
    "recipe - frozen head": [o for o in SPECULATORS_RECIPE if not o.startswith("train.freeze_lm_head")],
    "recipe + ttt 5": [*SPECULATORS_RECIPE, "ttt.num_steps=5"],
    # the recipe's loss still falls steeply at its last steps at 2e-3 (under-trained at this budget)
    "recipe lr=5e-3": [*SPECULATORS_RECIPE, "train.lr=5e-3"],
    "recipe lr=1e-2": [*SPECULATORS_RECIPE, "train.lr=1e-2"],
    # the same trained tokens in 512-token rows: 5.4x the optimizer steps (every anchor conversation is shorter
    # than 512 tokens, so no sample is cut); the recipe looks step-limited at 359 steps of 2048 tokens
    "recipe rows=512": [*SPECULATORS_RECIPE, "train.batch_tokens=512"],
    # the longest anchor conversation is 363 tokens: 384-token rows are the shortest that cut none (1.21x the
    # steps of 512): does the served gain of more steps go on?
    "recipe rows=384": [*SPECULATORS_RECIPE, "train.batch_tokens=384"],
    # Muon's Newton-Schulz iteration in fp32, as every CPU run iterated before train.muon_ns_precision (auto: bf16
    # where the run is bf16): side by side with "recipe rows=512", whose short rows pay the iteration most often
    "recipe rows=512 ns fp32": [*SPECULATORS_RECIPE, "train.batch_tokens=512", "train.muon_ns_precision=fp32"],
    # the loss lever: cross-entropy on the target's argmax (what greedy serving accepts) instead of forward KL on
    # its distribution; fp32 Newton-Schulz as "recipe rows=512" ran (seventh run), so the loss is the one change
    "recipe rows=512 argmax": [*SPECULATORS_RECIPE, "train.batch_tokens=512", "train.muon_ns_precision=fp32",
                               "train.teacher=argmax"],
    # regularisers for the served family (HumanEval), which the 512-token rows fit less than the training family
    # (sim 2.64, served 1.86): Gaussian noise on the aux hidden states at ~9 % of their median magnitude (2.2; the
    # 0.05 of the 120k runs was ~2 %), and half the lr (at 2048-token rows the higher lr scored higher held-out and
    # served lower). Newton-Schulz runs in bf16 (auto) in both, as in the tenth run's 512-token rows
    "recipe rows=512 noise 0.2": [*SPECULATORS_RECIPE, "train.batch_tokens=512", "train.hidden_noise_std=0.2"],
    "recipe rows=512 lr=1e-3": [*SPECULATORS_RECIPE, "train.batch_tokens=512", "train.lr=1e-3"],
    # more signal from the same data: the teacher is the target's distribution, which exists at prompt tokens too
    # (~28 % of the anchor's tokens), so training scores every token (train.loss_tokens=all), not the assistant
    # mask alone; and TTT depth 5 (serving drafts 3: do deeper unrolls teach the later positions more?)
    "recipe rows=512 lr=1e-3 all tokens": [*SPECULATORS_RECIPE, "train.batch_tokens=512", "train.lr=1e-3",
                                           "train.loss_tokens=all"],
    "recipe rows=512 lr=1e-3 ttt 5": [*SPECULATORS_RECIPE, "train.batch_tokens=512", "train.lr=1e-3",
                                      "ttt.num_steps=5"],
    # speculators' norm before fc is one RMSNorm over the concatenated aux layers, whose scale the top layers'
    # massive activations set (std 53.7 against a median |h| of 2.2): the low layers reach fc shrunk. EAGLE-3.1's
    # fc_norm normalises each aux layer on its own; the one change against "recipe rows=512 lr=1e-3"
    "recipe rows=512 lr=1e-3 fc_norm": [*[o for o in SPECULATORS_RECIPE if o != "drafter.norm_before_fc=true"],
                                        "drafter.fc_norm=true", "train.batch_tokens=512", "train.lr=1e-3"],
}
# the best so far with a deeper unroll: steps 4 and 5 train the drafter on its own drafts as inputs two more times
# per position; serving drafts 3, so they count only through what they teach the shared weights
VARIANTS["recipe rows=512 lr=1e-3 fc_norm ttt 5"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"], "ttt.num_steps=5"]
# and depth 7, the GPU recipes' unroll and the last depth issue #12 lists (depth 5 served inside the seed spread
# of depth 3 at 1.7x the step cost: does the gain start later?)
VARIANTS["recipe rows=512 lr=1e-3 fc_norm ttt 7"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"], "ttt.num_steps=7"]
# the best so far with the draft head (and its final norm) still started from the target's but trained, as our base
# recipe trains its head: frozen, the 8192-row draft head cannot move toward what the one-layer drafter can
# predict (AdamW full budget: frozen 1.510 served against a trained random head's 1.549)
VARIANTS["recipe rows=512 lr=1e-3 fc_norm trained head"] = [
    o for o in VARIANTS["recipe rows=512 lr=1e-3 fc_norm"] if not o.startswith("train.freeze_lm_head")]
# the best so far drafting over the target's whole vocab (49152) instead of the 32000 ids most frequent in the
# training family's assistant tokens: with the target's frozen head, a token the training rows never show can still
# be drafted when the drafter's hidden state predicts it, and the served family (code) uses ids the chat family
# does not; the same captured shards, only the vocab (rebuilt from the saved counts) differs
VARIANTS["recipe rows=512 lr=1e-3 fc_norm full vocab"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"],
                                                          "data.draft_vocab_size=49152"]
# the best so far reading the target's upper layers, its last one's output included ([20, 25, 30] of 30 layers:
# two thirds, five sixths, the last), where vLLM's default is [2, 15, 27]: the frozen head predicts from the last
# layer's stream, and NVIDIA's gpt-oss-120b-Eagle3-v3 reads [24, 30, 36] of 36. Needs its own capture of the same
# conversations (dataset_with_aux_layers); the split, token counts and draft vocab are the base dataset's.
# (train.layer_init=target_last, the decoder layer started as the target's last one, served 1.671 and was
# reverted: results-levers-cpu.txt, eighteenth run.)
VARIANTS["recipe rows=512 lr=1e-3 fc_norm aux 20,25,30"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"],
                                                            "target.aux_layer_ids=[20,25,30]"]
# distillation temperature on the best so far: the teacher's and the drafter's logits both divided by 2 before the
# softmax, the loss times 4 (Hinton et al.). The distribution teacher served above the argmax one (ninth run: the
# runners-up carry what transfers to the served family); a softer teacher weighs them more
VARIANTS["recipe rows=512 lr=1e-3 fc_norm T=2"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"],
                                                   "train.teacher_temperature=2"]
# token-alignable training (GRIFFIN, top 3 as its recipe) on the best so far: step j is scored at a position only
# where every earlier step there kept the target's argmax in its top 3. Served acceptance at step j is conditional
# on steps < j accepted, so the positions dropped teach step j inputs (the drafter's own hidden state after a miss)
# that serving never feeds it; the capacity goes to the positions that count
VARIANTS["recipe rows=512 lr=1e-3 fc_norm align top3"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"],
                                                          "ttt.alignment_topk=3"]
# and top 1, exactly greedy serving's condition (top 3 served 0.975x the fc_norm recipe: does the exact one differ?)
VARIANTS["recipe rows=512 lr=1e-3 fc_norm align top1"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"],
                                                          "ttt.alignment_topk=1"]
# the lr on the best so far, both ways: without fc_norm, half the lr served higher at 512-token rows (1e-3 1.886
# against 2e-3 1.855) and at 2048-token rows the higher lr scored higher held-out and served lower, so the served
# family may favour a still lower lr; fc_norm's per-layer normalised input may instead take a higher one
VARIANTS["recipe rows=512 lr=5e-4 fc_norm"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"], "train.lr=5e-4"]
VARIANTS["recipe rows=512 lr=2e-3 fc_norm"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"], "train.lr=2e-3"]
# not a lever of item 3 (the issue fixes 1 layer): a second decoder layer on the best recipe tests the other half
# of the reason item 3 is called blocked, that the gap needs a deeper drafter (or more data), by measurement
VARIANTS["recipe rows=512 lr=1e-3 fc_norm 2 layers"] = [*VARIANTS["recipe rows=512 lr=1e-3 fc_norm"],
                                                        "drafter.num_layers=2"]
# variants that leave the architecture item 3 fixes (1 layer, 3 TTT steps at serving, draft vocab 32000):
# bench/levers_table.py marks them, as they do not count for item 3
BEYOND_FIXED_ARCHITECTURE = {"recipe rows=512 lr=1e-3 fc_norm 2 layers"}


def override_value(extra: list[str], key: str) -> str | None:
    """The value a variant's overrides give `key` (the last one wins, as in the config loader), else None."""
    values = [o.split("=", 1)[1] for o in extra if o.startswith(f"{key}=")]
    return values[-1] if values else None


def row_tokens_of(extra: list[str]) -> int:
    """The row length a variant trains with: its own train.batch_tokens, else the anchor's."""
    return int(override_value(extra, "train.batch_tokens") or vs_speculators.ROW_TOKENS)


def dataset_with_draft_vocab(dataset_dir: Path, size: int) -> Path:
    """The captured dataset with a draft vocab of `size`: every file hard-linked but the vocab, which is rebuilt
    from the loss-masked token counts data/build.py saved beside it, as data.draft_vocab_size=size builds it."""
    import os

    from safetensors.torch import load_file

    from draftsmith.data.vocab import build_draft_vocab, save_vocab

    out = dataset_dir.parent / f"{dataset_dir.name}-vocab{size}"
    if (out / "vocab.safetensors").is_file():
        return out
    for src in dataset_dir.rglob("*"):
        dst = out / src.relative_to(dataset_dir)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif src.name != "vocab.safetensors" and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    counts = load_file(str(dataset_dir / "vocab.safetensors"))["counts"]
    d2t, t2d = build_draft_vocab(counts, size)
    save_vocab(out / "vocab.safetensors", d2t, t2d, counts)
    return out


def dataset_with_aux_layers(out: Path, conversations: Path, aux_layer_ids: str) -> Path:
    """The same conversations captured again at other aux layers (`target.aux_layer_ids`), built once by
    data/build.py beside the base dataset."""
    aux_out = out.parent / f"{out.name}-aux{aux_layer_ids.strip('[]').replace(',', '-')}"
    seconds, cached = vs_speculators.build_dataset_once(aux_out, conversations,
                                                        [f"target.aux_layer_ids={aux_layer_ids}"])
    if not cached:
        print(f"  captured at aux layers {aux_layer_ids} in {seconds:.0f} s: {aux_out}", flush=True)
    return RunPaths.at(aux_out).dataset.dir


def train_variant(out: Path, conversations: Path, steps: int, seed: int, name: str, extra: list[str],
                  reuse: bool = False) -> dict:
    """Train one variant from scratch; with `reuse`, a run of the same overrides that finished (its held-out
    evaluation written) is taken as it is, so an interrupted levers run goes on where it stopped."""
    seed_suffix = f"_seed{seed}" if seed else ""  # another seed trains beside the seed-0 run, not over it
    run = out / "levers" / (name.replace(" ", "_").replace("=", "") + seed_suffix)
    dataset_dir = RunPaths.at(out).dataset.dir
    if aux_layer_ids := override_value(extra, "target.aux_layer_ids"):
        dataset_dir = dataset_with_aux_layers(out, conversations, aux_layer_ids)
    if override_value(extra, "data.draft_vocab_size"):
        dataset_dir = dataset_with_draft_vocab(dataset_dir, int(override_value(extra, "data.draft_vocab_size")))
    overrides = vs_speculators.draftsmith_overrides(run, conversations, steps) + [
        f"data.dataset_dir={dataset_dir}", f"train.seed={seed}", *extra]
    paths = RunPaths.at(run)
    done = run / "levers-run.json"
    if reuse and paths.eval_heldout.is_file() and done.is_file() and \
            json.loads(done.read_text())["config_overrides"] == overrides:
        seconds = json.loads(done.read_text())["seconds"]
        print(f"  {name}: reusing the finished run in {run}", flush=True)
    else:
        vs_speculators.fresh_dir(run)
        seconds = vs_speculators.run_stage("train/eagle3.py", overrides, run.parent / f"{run.name}.log")
        done.write_text(json.dumps({"config_overrides": overrides, "seconds": seconds}))
    result = json.loads(paths.eval_heldout.read_text())
    rate = vs_speculators.training_rate(paths.metrics)
    return {"name": name, "overrides": extra, "seconds": seconds, "tokens_per_s": rate["tokens_per_s"],
            "final_loss": rate["losses"][-1], "eval": result, "run_dir": str(run), "config_overrides": overrides}


# the lines bench/levers_table.py reads back from results-levers-cpu.txt (tests/train/test_levers_table.py checks the round trip)
def sim_line(result: dict, seconds: float) -> str:
    """One variant's held-out figures, as a levers run prints them."""
    acc = result["eval"]["per_step_accuracy"]
    return (f"  {result['name']:28} sim AL K=3 {result['eval']['simulated_acceptance_length']['3']:.3f}  acc "
            f"{' / '.join(f'{x:.3f}' for x in acc)}  final loss {result['final_loss']:.3f}  "
            f"{result['tokens_per_s']:.0f} tok/s  ({seconds:.0f} s)")


def served_line(name: str, served: dict) -> str:
    """One variant's served figures (vs_speculators.serve_side_by_side's entry), as a levers run prints them."""
    return (f"  {name:28} served AL K=3 {served['acceptance_length']:.3f}  per position "
            f"{' / '.join(f'{x:.3f}' for x in served['per_position'])}  lossless {served['lossless']}  "
            f"{served['output_tokens_per_s']:.1f} output tokens/s")


def serve_variants(results: list[dict], out: Path) -> dict:
    """Export every variant and serve them all at K=3 beside the target alone, on the same HumanEval prompts."""
    from draftsmith.data.target import resolve_target_path

    drafters = {}
    for r in results:
        drafter = RunPaths.at(Path(r["run_dir"])).drafter
        vs_speculators.run_stage("export/speculators.py", r["config_overrides"], Path(r["run_dir"]) / "export.log",
                                 ["--out", str(drafter)])
        drafters[r["name"]] = drafter
    budget = vs_speculators.BUDGETS["full"]
    return vs_speculators.serve_side_by_side(str(resolve_target_path("smollm2")), drafters,
                                             vs_speculators.human_eval_prompts(vs_speculators.work_dir()),
                                             budget[1], budget[2], out / "levers-serve-logs")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=120_000, help="trained tokens per variant")
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="variants to run (default all)")
    p.add_argument("--combine", nargs="+", default=[], help="also run these variants' overrides together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="take variants whose run of the same overrides finished "
                                                        "from that run instead of training them again")
    p.add_argument("--serve", action="store_true", help="also export and serve every variant at K=3 (vLLM, "
                                                        "164 HumanEval prompts x 128 tokens, beside the target alone)")
    a = p.parse_args(argv)
    rows = speculators_side.read_anchor_conversations()
    rows = rows[: speculators_side.num_conversations_for(a.budget, rows)]
    out = vs_speculators.work_dir() / f"draftsmith-first{len(rows)}"
    conversations = vs_speculators.anchor_jsonl(rows, out / "conversations.jsonl")
    vs_speculators.build_dataset_once(out, conversations)
    steps, tokens = vs_speculators.steps_for_budget(RunPaths.at(out).dataset.dir, a.budget, a.seed)
    print(f"$ .venv/bin/python bench/levers.py --budget {a.budget}; {len(rows)} anchor conversations, {steps} steps "
          f"= {tokens} trained tokens per variant, seed {a.seed}", flush=True)
    plan = [(n, VARIANTS[n]) for n in (a.only or VARIANTS)]
    if a.combine:
        plan.append((" + ".join(a.combine), [o for n in a.combine for o in VARIANTS[n]]))
    results = []
    for name, extra in plan:
        t0 = time.time()
        variant_steps = steps
        if row_tokens_of(extra) != vs_speculators.ROW_TOKENS:  # same trained tokens in rows of another length
            variant_steps, variant_tokens = vs_speculators.steps_for_budget(
                RunPaths.at(out).dataset.dir, a.budget, a.seed, row_tokens_of(extra))
            print(f"  {name}: rows of {row_tokens_of(extra)} tokens, {variant_steps} steps = {variant_tokens} "
                  "trained tokens", flush=True)
        r = train_variant(out, conversations, variant_steps, a.seed, name, extra, a.reuse)
        results.append(r)
        print(sim_line(r, time.time() - t0), flush=True)
    base = next((r for r in results if r["name"] == "base"), None)
    if base:
        b = base["eval"]["simulated_acceptance_length"]["3"]
        print("relative to base: " + ", ".join(
            f"{r['name']} {r['eval']['simulated_acceptance_length']['3'] / b:.3f}x" for r in results))
    (out / f"levers-{a.budget}.json").write_text(json.dumps(results, indent=1))
    if a.serve:
        served = serve_variants(results, out)
        for r in results:
            print(served_line(r["name"], served[r["name"]]), flush=True)
        print(f"  (target alone {served['none']['output_tokens_per_s']:.1f} output tokens/s; {served['num_prompts']} "
              f"HumanEval prompts x {served['max_tokens']} tokens, greedy, fp32)")
        (out / f"levers-{a.budget}-served.json").write_text(json.dumps(served, indent=1))


if __name__ == "__main__":
    main()
