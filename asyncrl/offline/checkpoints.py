"""What `asyncrl eval` / `asyncrl generate` were pointed at, as a Hugging Face directory an engine loads.

A MODEL argument is one of (checked in this order, the first that fits wins):
  - a run dir (holds `run.json`): its `final/` export, else its newest complete checkpoint;
  - an asyncrl training checkpoint (`checkpoints/step_N`, holding the `COMPLETE` marker): exported once to
    a plain HF dir (asyncrl/learner/export.py) inside the command's output dir;
  - a Hugging Face directory (`config.json` and weights: *.safetensors or pytorch_model*.bin);
  - anything else `model.path` accepts (a hub id in the local cache, asyncrl/models.py).
Anything that fits none of these is a `CheckpointPathError` saying what was looked for where. A run dir's
recorded overrides (`overrides.yaml`) come with it, so that evaluation uses the env and agent it trained with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from asyncrl.learner.checkpoint import MARKER
from asyncrl.run_dir import RECORD, RunLayout, latest_checkpoint

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.safetensors.index.json")


class CheckpointPathError(ValueError):
    """MODEL names nothing an engine can load; the message says what was looked for where."""


@dataclass
class ModelSource:
    """Where a MODEL argument leads: an HF dir now (`hf_dir`), or a training checkpoint to export first."""

    label: str  # what the summary calls it: the path as given, or "base model" for the configured one
    hf_dir: Optional[Path] = None
    training_checkpoint: Optional[Path] = None
    run_dir: Optional[Path] = None  # the run it belongs to, if any
    run_overrides: list[str] = field(default_factory=list)  # that run's command-line overrides


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(any(path.glob(g)) for g in WEIGHT_GLOBS)


def is_training_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file() or (path / MARKER).is_file()


def owning_run_dir(path: Path) -> Optional[Path]:
    """The run dir `path` is (run.json), or lies in as `final/` or `checkpoints/step_N`."""
    for candidate in (path, path.parent, path.parent.parent):
        if RunLayout(candidate).record.is_file():
            return candidate
    return None


def run_overrides(run_dir: Path) -> list[str]:
    """The run's recorded command-line overrides (`overrides.yaml`), minus what only a training run uses."""
    f = RunLayout(run_dir).overrides
    if not f.is_file():
        return []
    try:
        items = yaml.safe_load(f.read_text()) or []
    except yaml.YAMLError as e:
        raise CheckpointPathError(f"{f}: not a YAML list of overrides ({e})") from None
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise CheckpointPathError(f"{f}: expected a YAML list of override strings, got {type(items).__name__}")
    return [x for x in items if not x.lstrip("+~").startswith(("trainer.", "model.path="))]


def resolve_model_source(spec: Optional[str]) -> ModelSource:
    """See the module docstring. `spec` None: the configured model (model.path or the default)."""
    if spec is None:
        return ModelSource(label="base model")
    path = Path(spec).expanduser()
    if not path.exists():
        if "/" in spec and not spec.startswith((".", "/", "~")) and spec.count("/") == 1:
            return ModelSource(label=spec)  # a hub id: resolved (offline) like model.path
        raise CheckpointPathError(f"MODEL {spec!r}: no such file or directory (looked at {path.resolve()})")
    if not path.is_dir():
        raise CheckpointPathError(f"MODEL {spec!r} is a file; expected a run dir, a checkpoint dir or a Hugging "
                                  "Face model dir")
    path = path.resolve()
    run = owning_run_dir(path)
    overrides = run_overrides(run) if run is not None else []
    if run is not None and path == run:
        layout = RunLayout(run)
        if is_hf_dir(layout.final):
            return ModelSource(label=spec, hf_dir=layout.final, run_dir=run, run_overrides=overrides)
        latest = latest_checkpoint(layout.checkpoints)
        if latest is not None and (latest / MARKER).is_file():
            return ModelSource(label=spec, training_checkpoint=latest, run_dir=run, run_overrides=overrides)
        raise CheckpointPathError(f"MODEL {spec!r} is a run dir with nothing to evaluate: no exported model in "
                                  f"{layout.final} and no complete checkpoint under {layout.checkpoints}")
    if is_training_checkpoint(path):
        if not (path / MARKER).is_file():
            raise CheckpointPathError(f"MODEL {spec!r} is an incomplete training checkpoint (no {MARKER} marker: its "
                                      "save did not finish); use an earlier one")
        return ModelSource(label=spec, training_checkpoint=path, run_dir=run, run_overrides=overrides)
    if is_hf_dir(path):
        return ModelSource(label=spec, hf_dir=path, run_dir=run, run_overrides=overrides)
    found = sorted(p.name for p in path.iterdir())[:8]
    raise CheckpointPathError(
        f"MODEL {spec!r} is not a model: expected a Hugging Face dir (config.json and *.safetensors or "
        f"pytorch_model*.bin), an asyncrl checkpoint (checkpoints/step_N with {MARKER}) or a run dir ({RECORD.name} "
        f"and final/); it holds {found or 'nothing'}"
    )
