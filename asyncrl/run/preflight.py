"""Preflight: everything a run needs that can be checked in seconds, checked before Ray starts.

`preflight(cfg)` runs each check below and either returns a `PreflightReport` (what the run will
use: model directory, training rows, tools, the longest prompt) or raises `PreflightError` with one
line per problem found, all of them (a check that depends on an earlier one's result is skipped when
that one failed, so one mistake is not reported three times). It writes nothing and starts nothing:
`asyncrl train` runs it before the controller creates the output dir, and `asyncrl train --dry-run`
runs only it.

Checks:
  plugins   every `plugins:` source imports (a syntax error or a missing module is one line naming
            the plugin, the file and the line);
  names     agent.name, agent.tool_parser, env.name, env.reward, every env.interactions class,
            algorithm.adv_estimator and algorithm.loss, and the off-policy guardrail (stale tokens with
            nothing correcting them are refused: asyncrl/learner/losses.py, check_off_policy_correction);
  tools     env.tools and env.tools_config (verl YAML) resolve to tool classes with valid schemas;
  model     model.path holds a Hugging Face checkpoint (config.json, weights, tokenizer); for the
            default model, its converted cache or the GGUF it is converted from (never converted here);
  rows      the training file opens (footer or line index, required columns: asyncrl/data/dataset.py) and a
            sample of its rows (every row of a set of at most SAMPLE_ROWS, else whole blocks spread over
            the file) is valid; the first trainer.eval_samples evaluation rows too when
            trainer.eval_every > 0, every one of them; each distinct `agent_name` and
            `extra_info.interaction_kwargs.name` in the rows read resolves. A bad training row outside
            the sample is found when drawn: it fails that group's episodes (or, with env.skip_bad_rows,
            is passed over), naming the file and row (asyncrl/rollout/prompts.py);
  prompts   each row read's prompt, rendered as its agent loop renders it (the loop's `chat_format`:
            the chat template, system prompt, tool schemas), fits agent.max_prompt_tokens. Training rows
            that do not fit are an error, or, with env.skip_bad_rows, marked to be skipped when drawn
            with a warning (counted in the report; the run trains on the rest; a row outside the sample
            that does not fit fails its episodes with PromptTooLongError). Evaluation rows that do not
            fit are always an error: dropping them would change what the evaluation measures from one
            run to the next;
  warm start warm_start.mode=on with an env or agent that cannot demonstrate, or an agent.tool_parser that
            cannot write its turns (no `render`; asyncrl/sft/warm_start.py `why_not`), is an error; auto there,
            or with a model.path of the user's own, a warning.
Numeric ranges are the config schema's (`asyncrl/config.py`, checked at load).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from asyncrl import registry
from asyncrl.agents.base import interaction_class, resolve_agent
from asyncrl.agents.tool_calls import resolve_parser
from asyncrl.config import Config, ToolSpec
from asyncrl.data.dataset import BLOCK_ROWS, LARGE_ROW_GROUP, Dataset
from asyncrl.data.rows import DataError
from asyncrl.envs.base import Env, Sample, load_rows, resolve_env, resolve_reward_fn
from asyncrl.learner.losses import check_off_policy_correction
from asyncrl.learner.memory_estimate import (
    SMOLLM2_135M,
    ModelShape,
    StepEstimate,
    learner_step,
    lower_learner_memory,
)
from asyncrl.models import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    default_model_cache_dir,
    find_gguf,
    is_cached,
    local_model_path,
    tokenizer_from_dir,
)
from asyncrl.sft.warm_start import skipped_because
from asyncrl.tools.loader import load_tool_specs, tool_name, tool_schemas
from asyncrl.util.cpus import native_bf16
from asyncrl.util.memory import machine_used

log = logging.getLogger("asyncrl.run.preflight")
SHOW_ROWS = 5  # rows named in one problem line; the rest are counted
SAMPLE_ROWS = 2048  # training rows read and checked before a run (every row of a smaller set)
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class PreflightError(ValueError):
    """The run cannot start: `problems` holds one line per mistake found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass
class PreflightReport:
    model: str  # the checkpoint directory, or the GGUF the default model will be converted from
    train_rows: Dataset  # what the run trains on (overlong rows found marked to be skipped, with skip_bad_rows)
    checked_rows: int  # training rows read and checked (a sample of a large set)
    num_val_rows: int
    agents: list[str]  # agent.name first, then other agent_name values of the rows
    tools: list[str]
    longest_prompt: int  # tokens, over the rows kept
    max_prompt_tokens: int
    dropped_rows: list[tuple[int, int]] = field(default_factory=list)  # (row index, prompt tokens)
    warnings: list[str] = field(default_factory=list)
    warm_start: str = "none"  # what runs before RL (asyncrl/sft/warm_start.py)
    micro_batch_tokens: int = 0  # what the learner packs to (trainer.learner_memory_gb may lower the config's)
    notes: list[str] = field(default_factory=list)  # what the preflight chose, and why

    def summary(self) -> str:
        dropped = f", {len(self.dropped_rows)} dropped (prompt too long)" if self.dropped_rows else ""
        n = len(self.train_rows)
        checked = f" ({self.checked_rows} of them checked)" if self.checked_rows < n else ""
        return "\n".join([
            f"model: {self.model}",
            f"rows: {n - len(self.dropped_rows)} training{checked}{dropped}, {self.num_val_rows} evaluation",
            f"agent: {', '.join(self.agents)}",
            f"tools: {', '.join(self.tools) or '(none)'}",
            f"longest prompt: {self.longest_prompt} tokens (limit agent.max_prompt_tokens={self.max_prompt_tokens})",
            f"warm start: {self.warm_start}",
        ])


class _Problems(list):
    """Problem lines, and `attempt` to run a step and turn its exception into one."""

    def attempt(self, where: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # every failure becomes a line of the report, never a traceback
            self.append(f"{where}: {_one_line(e)}" if where else _one_line(e))
            return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ----------------------------------------------------------------------------- the checks


def check_plugins(sources: list[str]) -> list[str]:
    """Import the entry points and each `plugins:` source; one line per source that fails."""
    problems = _Problems()
    problems.attempt("", registry.load_entry_points)
    for s in sources:
        problems.attempt("", lambda s=s: registry.load_source(s))
    return problems


def check_env(cfg: Config) -> tuple[Optional[Env], list[str]]:
    """env.name is a registered env, and env.reward (a file's function or a registered reward) resolves."""
    problems = _Problems()
    env = problems.attempt("env.name", lambda: resolve_env(cfg.env.name))
    if env is not None:
        problems.attempt("env.reward", lambda: resolve_reward_fn(cfg.env))
    return env, problems


def check_names(cfg: Config) -> list[str]:
    """The config's named plugins resolve: agent loop, tool parser, interaction classes."""
    problems = _Problems()
    problems.attempt("agent.name", lambda: resolve_agent(cfg.agent.name))
    if cfg.agent.tool_parser != "auto":  # auto is resolved against the tokenizer, below
        problems.attempt("agent.tool_parser", lambda: registry.get("tool_parser", cfg.agent.tool_parser))
    for i, spec in enumerate(cfg.env.interactions):
        problems.attempt(f"env.interactions[{i}] ({spec.name!r})", lambda spec=spec: interaction_class(spec.name, [spec]))
    if cfg.algorithm.adv_estimator != "gae":  # gae is the critic's (asyncrl/learner/critic.py), not a plugin
        problems.attempt("algorithm.adv_estimator", lambda: registry.get("advantage", cfg.algorithm.adv_estimator))
    loss = problems.attempt("algorithm.loss", lambda: registry.get("loss", cfg.algorithm.loss))
    if loss is not None:
        refused = check_off_policy_correction(cfg.algorithm, loss)
        if refused:
            problems.append(refused)
    return problems


def check_tools(cfg: Config) -> tuple[Optional[list[ToolSpec]], list[str]]:
    """env.tools + env.tools_config as the rollout workers will load them (classes resolved, schemas checked)."""
    problems = _Problems()
    specs = problems.attempt("", lambda: load_tool_specs(cfg.env.tools, cfg.env.tools_config))
    return specs, problems


def check_model(cfg: Config) -> tuple[Optional[str], list[str]]:
    """Where the tokenizer comes from: the checkpoint dir, or the default model's cache or GGUF file."""
    m = cfg.model
    if m.path:
        where = f"model.path={m.path!r}"
        try:
            path = local_model_path(m.path, m.allow_download)
        except ModelNotFoundError as e:
            return None, [_one_line(e)]
        if not path.is_dir():
            return None, [f"{where}: no such directory (looked at {path.resolve()})"]
        missing = []
        config_json = path / "config.json"  # the checkpoint's (Hugging Face) config, not the run's
        if not config_json.is_file():
            missing.append(config_json.name)
        if not any(next(path.glob(p), None) for p in WEIGHT_FILES):
            missing.append(f"weights ({', '.join(WEIGHT_FILES)})")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES)})")
        if missing:
            return None, [f"{where}: not a Hugging Face checkpoint directory ({path.resolve()}): "
                          f"missing {'; '.join(missing)}"]
        return str(path), check_context(cfg, config_json)
    if m.name != DEFAULT_MODEL:
        return None, [f"model.name={m.name!r}: not a known default model (known: {DEFAULT_MODEL!r}); "
                      "use model=custom model.path=DIR"]
    cached = default_model_cache_dir(m)
    if is_cached(cached):
        return str(cached), []
    try:
        return str(find_gguf()), []
    except ModelNotFoundError as e:
        return None, [_one_line(e)]


def check_context(cfg: Config, config_json: Path) -> list[str]:
    """An episode's whole budget (agent.max_prompt_tokens + agent.max_response_tokens) fits the model's
    context (config.json's max_position_embeddings): an engine refuses a request past it (SGLang's rule),
    which would fail the episodes that grow that long, late in the run."""
    try:
        context = json.loads(config_json.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return []  # the checkpoint check above names an unreadable config
    budget = cfg.agent.max_prompt_tokens + cfg.agent.max_response_tokens
    if isinstance(context, int) and not isinstance(context, bool) and 0 < context < budget:
        return [f"agent.max_prompt_tokens + agent.max_response_tokens = {cfg.agent.max_prompt_tokens} + "
                f"{cfg.agent.max_response_tokens} = {budget} tokens is more than the model's context of {context} "
                f"tokens (max_position_embeddings in {config_json}): lower them"]
    return []


def load_tokenizer(source: str) -> Any:
    """The tokenizer of a checkpoint dir, or of the default model's GGUF file (before its conversion)."""
    p = Path(source)
    if not p.is_file():
        return tokenizer_from_dir(p)
    # lazy: imports transformers, which this module does not load otherwise
    from transformers import AutoTokenizer  # seconds to import: only once a tokenizer is needed

    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def check_row_names(rows: list[dict[str, Any]], cfg: Config, split: str,
                    indices: Optional[list[int]] = None) -> list[str]:
    """Each distinct `agent_name` and interaction name in `rows` resolves (a row names its loop, verl-style).
    `indices` are the rows' indices in their file (default 0, 1, ...)."""
    agents: dict[str, list[int]] = {}
    interactions: dict[str, list[int]] = {}
    for i, row in zip(indices or range(len(rows)), rows):
        if row.get("agent_name"):
            agents.setdefault(str(row["agent_name"]), []).append(i)
        kw = (row.get("extra_info") or {}).get("interaction_kwargs") or {}
        if kw.get("name"):
            interactions.setdefault(str(kw["name"]), []).append(i)
    problems = _Problems()
    for name, idx in agents.items():
        problems.attempt(f"{_rows(split, idx)}: agent_name", lambda name=name: resolve_agent(name))
    for name, idx in interactions.items():
        problems.attempt(f"{_rows(split, idx)}: extra_info.interaction_kwargs.name {name!r} is neither in "
                         "env.interactions nor registered", lambda name=name: interaction_class(name, cfg.env.interactions))
    return problems


def _rows(split: str, idx: list[int]) -> str:
    shown = ", ".join(str(i) for i in idx[:SHOW_ROWS])
    more = f" and {len(idx) - SHOW_ROWS} more" if len(idx) > SHOW_ROWS else ""
    return f"{split} row{'s' if len(idx) > 1 else ''} {shown}{more}"


def prompt_lengths(rows: list[dict[str, Any]], cfg: Config, tokenizer: Any, schemas: list[dict[str, Any]]) -> list[int]:
    """Each row's prompt length in tokens, rendered as its agent loop renders it (`AgentLoop.chat_format`)."""
    formats: dict[str, Any] = {}
    texts = []
    for i, row in enumerate(rows):
        name = row.get("agent_name") or cfg.agent.name
        if name not in formats:
            formats[name] = resolve_agent(name).chat_format(tokenizer, cfg.agent, schemas)
        chat = formats[name]
        sample = Sample.from_row(row, data_index=i, group_id="preflight", sample_index=0, group_size=1)
        texts.append(chat.render(chat.prompt_messages(sample.messages), add_generation_prompt=True))
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def too_long(lengths: list[int], limit: int, split: str, indices: Optional[list[int]] = None) -> Optional[str]:
    """One line naming the rows whose prompt exceeds `limit` tokens (the longest first), or None.
    `indices` are the rows' indices in their file (default 0, 1, ...)."""
    over = sorted(((n, i) for n, i in zip(lengths, indices or range(len(lengths))) if n > limit), reverse=True)
    if not over:
        return None
    shown = ", ".join(f"row {i} ({n:,} tokens)" for n, i in over[:SHOW_ROWS])
    more = ", ..." if len(over) > SHOW_ROWS else ""
    return (f"{len(over)} of {len(lengths)} {split} rows have prompts longer than agent.max_prompt_tokens={limit}: "
            f"{shown}{more}")


def check_training_sample(ds: Dataset) -> tuple[list[int], list[dict[str, Any]], list[str]]:
    """The valid (indices, rows) among `ds.sample_indices(SAMPLE_ROWS)`, and warnings; DataError at the first
    bad one unless the dataset skips bad rows, or when none is valid."""
    indices, rows, bad = [], [], []
    for i in ds.sample_indices(SAMPLE_ROWS):
        try:
            rows.append(ds[i])
        except DataError as e:
            bad.append(e)
        else:
            indices.append(i)
    if bad and not ds.skip_bad:
        raise bad[0]
    if not rows:
        raise DataError(f"no valid rows among the {len(bad)} checked (first: {bad[0]})", source=ds.source)
    warnings = [f"{len(bad)} of {len(bad) + len(rows)} checked training rows are bad and will be skipped when "
                f"drawn (env.skip_bad_rows=true; first: {bad[0]})"] if bad else []
    if ds.largest_row_group > LARGE_ROW_GROUP:
        warnings.append(f"{ds.source}: row groups of up to {ds.largest_row_group} rows: each prompt drawn decodes "
                        f"up to that many rows in every rollout worker (CPU and memory); rewrite it with row groups "
                        f"of {BLOCK_ROWS} rows (pyarrow.parquet.write_table(..., row_group_size={BLOCK_ROWS}))")
    return indices, rows, warnings


# ----------------------------------------------------------------------------- all of them


MICRO_BATCH_STEP = 256  # trainer.learner_memory_gb chooses algorithm.micro_batch_tokens in these steps


@dataclass(frozen=True)
class LearnerMemoryFit:
    micro_batch_tokens: int  # what the run uses: the configured value, or lower to fit trainer.learner_memory_gb
    problems: list[str]
    notes: list[str]  # what was changed, and why


def check_learner_memory(cfg: Config, model_dir: str) -> LearnerMemoryFit:
    """The learner's step, estimated (asyncrl/learner/memory_estimate.py; the micro-batch is at least the
    longest sequence, which is packed alone), against trainer.learner_memory_gb and this machine's memory up
    to trainer.memory_stop_fraction. With a budget, algorithm.micro_batch_tokens is lowered to the largest
    multiple of MICRO_BATCH_STEP that fits it; a run whose learner cannot fit is refused, naming the settings.
    Only where the learner runs on this machine's CPU (a run that joins a Ray cluster, or a machine with a GPU,
    keeps its activations elsewhere), and for a model whose shape is known (a config.json, or the default)."""
    a, t = cfg.algorithm, cfg.trainer
    keep = LearnerMemoryFit(a.micro_batch_tokens, [], [])
    if cfg.ray.address or Path("/dev/nvidia0").exists():
        return keep
    config_json = Path(model_dir) / "config.json"
    try:
        shape = ModelShape.from_config(json.loads(config_json.read_text())) if config_json.is_file() else (
            SMOLLM2_135M if not cfg.model.path else None)
    except (OSError, ValueError, KeyError, TypeError):
        return keep  # check_context reads the same file and names what is wrong with it
    _, total = machine_used()
    if shape is None or not total:
        return keep
    lora = cfg.model.lora
    lora_params = lora.rank * 2 * shape.hidden * shape.layers * len(lora.target_modules) if lora.rank else 0
    ranks = t.learner_ranks
    longest = cfg.agent.max_prompt_tokens + cfg.agent.max_response_tokens

    def estimate(tokens: int) -> StepEstimate:
        return learner_step(shape, max(tokens, longest), a.logits_chunk_tokens, cfg.model.gradient_checkpointing,
                            bf16=cfg.model.cpu_bf16 and native_bf16(), ranks=ranks, lora_params=lora_params,
                            reference=a.kl_coef > 0)

    other_way = "" if cfg.model.gradient_checkpointing else " or set model.gradient_checkpointing=true"
    tokens, notes = a.micro_batch_tokens, []
    if t.learner_memory_gb and estimate(tokens).total_gb > t.learner_memory_gb:
        fits = next((n for n in range(tokens // MICRO_BATCH_STEP * MICRO_BATCH_STEP, 0, -MICRO_BATCH_STEP)
                     if estimate(n).total_gb <= t.learner_memory_gb), None)
        if fits is None:
            return LearnerMemoryFit(tokens, [
                f"the learner's step on one sequence of {longest} tokens (agent.max_prompt_tokens + "
                f"agent.max_response_tokens) is estimated at {estimate(0).describe()}, over "
                f"trainer.learner_memory_gb={t.learner_memory_gb:g}: raise it, or shorten the context{other_way}"],
                [])
        notes.append(f"trainer.learner_memory_gb={t.learner_memory_gb:g}: algorithm.micro_batch_tokens {tokens} -> "
                     f"{fits} (its step estimated at {estimate(fits).describe()})")
        tokens = fits
    est = estimate(tokens)
    budget = total * t.memory_stop_fraction
    if est.total_gb * ranks <= budget:
        return LearnerMemoryFit(tokens, [], notes)
    return LearnerMemoryFit(tokens, [
        f"the learner's step is estimated at {est.describe()}{f' on each of {ranks} ranks' if ranks > 1 else ''}"
        f", over trainer.memory_stop_fraction={t.memory_stop_fraction:g} of this machine's {total:.1f} GiB "
        f"({budget:.1f} GiB): {lower_learner_memory(tokens, cfg.model.gradient_checkpointing)}"], notes)


def check_warm_start(cfg: Config, env: Env, problems: list[str], warnings: list[str], tokenizer: Any = None) -> str:
    """warm_start.mode=on needs an env and agent that can demonstrate and an agent.tool_parser that renders (a
    problem otherwise); auto runs no warm start without them or with a model.path of the user's own (a warning
    saying which). Returns what will run before RL, for the report."""
    ws = cfg.warm_start
    reason = skipped_because(cfg, env, tokenizer) if ws.mode != "off" else None
    if ws.mode == "on" and reason:
        problems.append(f"warm_start.mode=on: {reason}; set warm_start.mode=off to start RL from model.path")
    elif reason:
        warnings.append(f"no warm start (warm_start.mode=auto): {reason}; RL starts from the configured model as "
                        f"it is")
    if ws.mode == "off" or reason:
        return "none"
    return (f"SFT on demonstrations of the first {ws.demos} training rows ({ws.epochs} epoch(s), lr {ws.lr:g}, "
            f"{ws.batch} a step), then RL from it")


def preflight(cfg: Config) -> PreflightReport:
    """Run every check; the report of what the run will use, or PreflightError listing every problem."""
    problems = _Problems(check_plugins(cfg.plugins))
    problems += check_names(cfg)
    env, env_problems = check_env(cfg)
    problems += env_problems
    specs, tool_problems = check_tools(cfg)
    problems += tool_problems
    model, model_problems = check_model(cfg)
    problems += model_problems
    dataset = sample = val = None
    if env is not None:
        dataset = problems.attempt(f"env={cfg.env.name} training rows", lambda: load_rows(cfg, env, "train"))
        if dataset is not None and not len(dataset):
            problems.append(f"env={cfg.env.name}: the training set is empty")
        elif dataset is not None:
            sample = problems.attempt(f"env={cfg.env.name} training rows", lambda: check_training_sample(dataset))
        if cfg.trainer.eval_every:  # the rows evaluation uses, every one of them
            val = problems.attempt(f"env={cfg.env.name} evaluation rows",
                                   lambda: load_rows(cfg, env, "val")[: cfg.trainer.eval_samples])
    indices, train, warnings = sample if sample is not None else ([], [], [])
    problems += check_row_names(train, cfg, "training", indices)
    problems += check_row_names(val or [], cfg, "evaluation")
    if problems or model is None or specs is None or not train:
        raise PreflightError(problems)

    tokenizer = problems.attempt(f"tokenizer of {model}", lambda: load_tokenizer(model))
    if tokenizer is None:
        raise PreflightError(problems)
    if cfg.agent.tool_parser == "auto":
        problems.attempt("agent.tool_parser", lambda: resolve_parser("auto", tokenizer))
        if problems:
            raise PreflightError(problems)
    schemas = tool_schemas(specs)
    limit = cfg.agent.max_prompt_tokens
    lengths = problems.attempt("prompt lengths", lambda: prompt_lengths(train, cfg, tokenizer, schemas)) or []
    val_lengths = problems.attempt("prompt lengths", lambda: prompt_lengths(val or [], cfg, tokenizer, schemas)) or []
    dropped = []
    long_train = too_long(lengths, limit, "training", indices)
    if long_train and cfg.env.skip_bad_rows:
        dropped = [(i, n) for i, n in zip(indices, lengths) if n > limit]
        warnings.append(f"{long_train}; dropped (env.skip_bad_rows=true)")
        dataset = dataset.skipping(i for i, _ in dropped)
        train = [r for r, n in zip(train, lengths) if n <= limit]
        lengths = [n for n in lengths if n <= limit]
        if not train:
            problems.append(f"every checked training row's prompt is longer than agent.max_prompt_tokens={limit}")
    elif long_train:
        problems.append(f"{long_train} (raise agent.max_prompt_tokens, or set env.skip_bad_rows=true to drop them)")
    long_val = too_long(val_lengths, limit, "evaluation")
    if long_val:
        problems.append(f"{long_val} (raise agent.max_prompt_tokens; evaluation rows are never dropped)")
    warm = check_warm_start(cfg, env, problems, warnings, tokenizer)
    memory = check_learner_memory(cfg, model)
    problems += memory.problems
    if problems:
        raise PreflightError(problems)
    agents = [cfg.agent.name] + sorted({str(r["agent_name"]) for r in train if r.get("agent_name")} - {cfg.agent.name})
    return PreflightReport(model=model, train_rows=dataset, checked_rows=len(dataset.sample_indices(SAMPLE_ROWS)),
                           num_val_rows=len(val or []), agents=agents,
                           tools=[tool_name(s) for s in specs], longest_prompt=max(lengths, default=0),
                           max_prompt_tokens=limit, dropped_rows=dropped, warnings=warnings, warm_start=warm,
                           micro_batch_tokens=memory.micro_batch_tokens, notes=memory.notes)
