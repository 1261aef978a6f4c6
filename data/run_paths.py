"""The layout of a run folder and of a dataset folder, the one place it is defined.

    runs/<config>/                 output_dir (default runs/<config name>)
      config.yaml                  the resolved config data/build.py ran with
      dataset/                     data.dataset_dir when set (a dataset another run built), else here
        build.json  manifest.json  vocab.safetensors  prompts-{train,heldout}.jsonl  regenerated.jsonl  shards
      train/                       config.yaml  precision.json  metrics.jsonl  tensorboard/  checkpoints/step-*
                                   best/  eval_heldout.json
      drafter/                     the exported speculators folder vLLM serves
      logs/                        vLLM server logs of validation
      validation.{json,md}  validation-acceptance.png
      hub/<org>--<name>/           the folder export/push.py uploads

Stages ask a `RunPaths` for a path; none joins folder names itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"  # written last: its presence means the dataset is complete (data/shards.py)


@dataclass(frozen=True)
class DatasetPaths:
    """The files of one dataset folder."""

    dir: Path

    @property
    def manifest(self) -> Path:
        return self.dir / MANIFEST

    @property
    def build_record(self) -> Path:
        """Target identity and aux ids the folder was started with (written first, checked on every rerun)."""
        return self.dir / "build.json"

    @property
    def build_lock(self) -> Path:
        """Held by the build writing the folder: its pid, host and start time (data/lock.py)."""
        return self.dir / "build.lock"

    @property
    def vocab(self) -> Path:
        return self.dir / "vocab.safetensors"

    @property
    def regenerated(self) -> Path:
        return self.dir / "regenerated.jsonl"

    def prompts(self, split: str) -> Path:
        """The conversations of a split as chat prompts (validation serves the held-out ones)."""
        return self.dir / f"prompts-{split}.jsonl"


@dataclass(frozen=True)
class RunPaths:
    """Every folder and file of one run, from its config."""

    run: Path
    dataset: DatasetPaths

    @classmethod
    def of(cls, cfg) -> RunPaths:
        """From a RunConfig: output_dir (else runs/<name>) and data.dataset_dir (else <run>/dataset)."""
        return cls.at(cfg.output_dir or f"runs/{cfg.name}", cfg.data.dataset_dir or None)

    @classmethod
    def at(cls, run, dataset=None) -> RunPaths:
        """A run folder given directly (benchmarks, tests); its dataset inside it unless given."""
        return cls(Path(run), DatasetPaths(Path(dataset) if dataset else Path(run) / "dataset"))

    @property
    def config_copy(self) -> Path:
        return self.run / "config.yaml"

    @property
    def train(self) -> Path:
        return self.run / "train"

    @property
    def train_config_copy(self) -> Path:
        return self.train / "config.yaml"

    @property
    def precision_record(self) -> Path:
        """The compute precision train.precision=auto chose at the run's start (kept on resume)."""
        return self.train / "precision.json"

    @property
    def checkpoints(self) -> Path:
        return self.train / "checkpoints"

    @property
    def best(self) -> Path:
        """The drafter bundle of the best held-out evaluation so far (export/speculators.py's input)."""
        return self.train / "best"

    @property
    def eval_heldout(self) -> Path:
        return self.train / "eval_heldout.json"

    @property
    def metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.train / "tensorboard"

    @property
    def wandb_run_id(self) -> Path:
        """The wandb run id a resumed run continues."""
        return self.train / "wandb-run-id"

    @property
    def drafter(self) -> Path:
        return self.run / "drafter"

    @property
    def server_logs(self) -> Path:
        return self.run / "logs"

    @property
    def validation_json(self) -> Path:
        return self.run / "validation.json"

    @property
    def validation_md(self) -> Path:
        return self.run / "validation.md"

    @property
    def validation_plot(self) -> Path:
        return self.run / "validation-acceptance.png"

    @property
    def validation_tpot_plot(self) -> Path:
        return self.run / "validation-tpot.png"

    def hub_staging(self, repo_id: str) -> Path:
        return self.run / "hub" / repo_id.replace("/", "--")
