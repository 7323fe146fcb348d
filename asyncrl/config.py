"""The typed configuration schema and its loader.

The Hydra tree in `configs/` is composed first (plain Hydra overrides), then the resulting
plain dict is converted into these dataclasses by `from_dict`, which fails on the first
unknown key or wrong type with a message that names the key path and the valid choices.
Range checks live in each section's `__post_init__`. Nothing starts before this passes.

Resolved here, once, and read by everyone else: `algorithm.max_staleness` is the staleness bound
of the run. `trainer.mode=sync` is the synchronous baseline, which means a bound of 0: `Config`
resolves it to 0 in sync mode whatever the override said, so the buffer (given the bound when it is
built), the admission gate and the learner all read the same number from one field.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from asyncrl.run_dir import check_run_name


def config_dir() -> Path:
    """The Hydra tree shipped as the `asyncrl.configs` package (the repo's configs/ when editable)."""
    spec = importlib.util.find_spec("asyncrl.configs")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the asyncrl.configs package is missing: reinstall asyncrl (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations)))


class ConfigError(ValueError):
    """A configuration value is missing, misspelled, of the wrong type or out of range."""


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A config field and its description, as data: `asyncrl train --help` and the CLI reference read the
    description from the field's metadata (`describe_field`). `factory` for a mutable default."""
    return field(default=default, default_factory=factory, metadata={"help": help})


def describe_field(f: dataclasses.Field) -> str:
    """A config field's description (empty when it has none)."""
    return str(f.metadata.get("help", ""))


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def sglang_dp_size(args: list[str]) -> int:
    """The data-parallel replicas SGLang 0.5.23 would run for these launch_server arguments (--dp-size,
    --data-parallel-size, --dp; 1 under --enable-dp-attention, which SGLang resolves to attn_dp_size)."""
    if "--enable-dp-attention" in args:
        return 1
    size = 1
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag in ("--dp-size", "--data-parallel-size", "--dp"):
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            try:
                size = int(value)
            except ValueError:
                raise ConfigError(f"engine.extra_args: {flag} needs an integer, got {value!r}") from None
    return size


def _at_least(section: Any, where: str, low: int, *names: str) -> None:
    """Each named field of `section` is >= `low` (workers, ranks, batch sizes, budgets, capacities)."""
    for n in names:
        v = getattr(section, n)
        _check(v >= low, f"{where}.{n}", f"must be >= {low}, got {v}")


def _positive(section: Any, where: str, *names: str) -> None:
    for n in names:
        v = getattr(section, n)
        _check(v > 0, f"{where}.{n}", f"must be > 0, got {v}")


# estimators whose baseline is the prompt's group of samples (asyncrl/learner/advantages.py); a group
# of one gets advantage 0. reinforce_pp normalizes over the batch and works with one sample a prompt.
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    rank: int = setting(
        0, "LoRA adapters of this rank on the target layers (asyncrl/learner/lora.py); 0: full fine-tuning")
    alpha: float = setting(16.0, "the adapter's scale is alpha / rank")
    target_modules: list[str] = setting(factory=lambda: list(LORA_TARGETS), help="linear layers, by name")
    seed: int = setting(0, "the adapters' initialisation (every rank builds the same)")

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "model.lora.rank", f"must be >= 0, got {self.rank}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(bool(self.target_modules), "model.lora.target_modules", "must name at least one layer")


@dataclass
class ModelConfig:
    name: str = setting("smollm2-135m", 'a known default model, or "custom" with `path`')
    path: Optional[str] = setting(
        None, "a local HF checkpoint dir, or a hub id (org/name) in the local HF cache; overrides `name`")
    allow_download: bool = setting(
        False, "a hub id missing from the local HF cache is downloaded (else: an error)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "the learner's and critic's weights: masters and optimizer state (auto, and compute: docs/design.md "
        '"Precision")',
    )
    attn_implementation: Optional[str] = setting(None, "None: sdpa (flash_attention_2 on GPU when installed)")
    gradient_checkpointing: bool = setting(
        False,
        "recompute activations in the backward pass (less memory, more compute): the policy's and critic's",
    )
    cache_dir: Optional[str] = setting(None, "where the default model's safetensors copy is cached")
    lora: LoraConfig = setting(
        factory=LoraConfig, help="LoRA adapters on the policy (rank 0: full fine-tuning)")
    cpu_bf16: bool = setting(
        False,
        'the learner and critic compute in bf16 where the CPU has native bf16 (docs/design.md "Precision")',
    )

    def __post_init__(self) -> None:
        if self.name == "custom" and not self.path:
            raise ConfigError("model=custom needs model.path (a local Hugging Face checkpoint directory)")


@dataclass
class EngineConfig:
    type: Literal["embedded", "sglang"] = setting(
        "embedded", "embedded: asyncrl's engine (any device); sglang: GPU")
    num_engines: int = setting(1, "inference servers launched (each serves the whole model)")
    urls: list[str] = setting(factory=list, help="attach to running servers instead of launching")
    host: str = setting(
        "127.0.0.1",
        "the address launched engines bind and are reached "
        "at; a non-loopback one needs ASYNCRL_ENGINE_TOKEN",
    )
    device: Optional[str] = setting(None, "None: cuda if available else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "the engine's weights and compute (docs/design.md \"Precision\")")
    max_running_seqs: int = setting(
        16,
        "the embedded engine's batch: requests decoded at once (asyncrl/engine/launcher.py "
        "launch_configured); SGLang sizes its own (not passed to it)",
    )
    cuda_graphs: bool = setting(
        True,
        "the embedded engine on a GPU replays its decode steps as CUDA graphs and admits waiting requests "
        "in batches of max_running_seqs // 8 rows (asyncrl/engine/graphs.py); false: every step eager",
    )
    max_running_tokens: int = setting(
        16384,
        "the embedded engine's prompt + generated tokens of the running requests; a longer prompt gets 400 "
        "(not passed to SGLang)",
    )
    launch_timeout_s: float = setting(
        300.0,
        "seconds a launched engine may take to answer /health; episodes "
        "also wait this long for an unreachable (relaunching) engine",
    )
    request_timeout_s: float = setting(
        180.0,
        "seconds a client waits for one /generate attempt: a silent engine is given "
        "up after (max_retries + 1) x this + backoff, ~9 min (a refused connection "
        "fails in under 2 s; the liveness probe kills a hung engine long before)",
    )
    max_retries: int = setting(
        2,
        "re-sends of a /generate after a transport error, a timeout "
        "or a 5xx, with exponential backoff (4xx: none)",
    )
    probe_timeout_s: float = setting(
        20.0,
        "liveness of launched engines: seconds the probe may take at each supervisor check (embedded: "
        "a one-token /generate; sglang: GET /health, SGLANG_HEALTH_CHECK_TIMEOUT set to this)",
    )
    probe_failures: int = setting(
        3,
        "... failed probes in a row (not counted while the engine is paused for a weight sync) "
        "before its process group is SIGKILLed and relaunched: about 3 x (20 s + 5 s) ~ 75 s",
    )
    mem_fraction_static: float = setting(0.4, "sglang only")
    extra_args: list[str] = setting(factory=list, help="sglang only, passed to launch_server")

    def __post_init__(self) -> None:
        _check(self.num_engines >= 1, "engine.num_engines", f"must be >= 1, got {self.num_engines}")
        _check(self.max_running_seqs >= 1, "engine.max_running_seqs", f"must be >= 1, got {self.max_running_seqs}")
        _at_least(self, "engine", 1, "max_running_tokens")
        _at_least(self, "engine", 0, "max_retries")
        _positive(self, "engine", "launch_timeout_s", "request_timeout_s")
        _check(0 < self.mem_fraction_static <= 1, "engine.mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static}")
        _positive(self, "engine", "probe_timeout_s")
        _at_least(self, "engine", 1, "probe_failures")


@dataclass
class SamplingConfig:
    temperature: float = setting(
        1.0, "sampling temperature of rollouts (the learner divides logits by it too)")
    top_p: float = setting(
        1.0, "nucleus sampling: draw from the most likely tokens whose mass reaches top_p (1: off)")
    top_k: int = setting(-1, "draw from the k most likely tokens (-1: off)")
    min_new_tokens: int = setting(
        0,
        "stop tokens are banned for a generation's first this many "
        "tokens (0: none; > 0 is refused with engine.type=sglang)",
    )

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "agent.sampling.temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "agent.sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "agent.sampling.top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _at_least(self, "agent.sampling", 0, "min_new_tokens")


@dataclass
class OpenAIAgentConfig:
    """agent=openai_agent: the user's OpenAI-client agent, run per episode against the proxy (asyncrl/proxy)."""

    function: Optional[str] = setting(None, "a registered openai_agent_fn, or module:fn / file.py:fn")
    command: Optional[list[str]] = setting(
        None, "else an external command (OPENAI_BASE_URL, OPENAI_API_KEY, sample on stdin)")
    timeout_s: float = setting(
        600.0, "one episode's wall clock; the command's process group is killed after it")
    turn_discount: float = setting(
        1.0, "a split call's reward: episode reward x discount ** (calls after it)")
    model_name: str = setting("asyncrl-policy", "what GET /v1/models lists")

    def __post_init__(self) -> None:
        _positive(self, "agent.openai", "timeout_s")
        _check(0.0 < self.turn_discount <= 1.0, "agent.openai.turn_discount", f"must be in (0, 1], got {self.turn_discount}")


@dataclass
class AgentConfig:
    name: str = setting("tool_agent", "a registered agent loop")
    max_assistant_turns: int = setting(
        4, "generations per episode at most (agent=openai_agent: model calls); then finish_reason max_turns")
    max_user_turns: int = setting(
        2, "interaction (simulated user) turns per episode at most; tool results are not user turns")
    max_turn_tokens: int = setting(256, "budget of one generation")
    max_response_tokens: int = setting(768, "budget of the whole trajectory after the prompt")
    max_prompt_tokens: int = setting(
        512,
        "tokens of the rendered prompt (chat template, system prompt, tool "
        "schemas); a longer row fails the preflight (env.skip_bad_rows: dropped)",
    )
    tool_parser: str = setting(
        "hermes",
        "how tool calls are read from the text, and written for SFT and the warm start (asyncrl plugins lists them; "
        "auto: from the chat template)",
    )
    tool_concurrency: int = setting(4, "tool calls of one turn run at once, at most")
    tool_timeout_s: float = setting(
        30.0,
        "seconds a tool's create, execute or release may take; an execute "
        "past it answers the model with a timeout error",
    )
    max_tool_response_tokens: int = setting(
        256, "a tool reply longer than this many tokens is cut in the middle (counted in tool_truncated)")
    max_consecutive_invalid_calls: int = setting(
        3,
        "invalid tool calls (bad JSON, unknown tool, bad arguments) "
        "in a row that end the episode (finish_reason invalid_calls)",
    )
    system_prompt: Optional[str] = setting(
        None,
        "the system message added to a row that has none (None: none, or "
        '"You are a helpful assistant." where tool instructions need one)',
    )
    sampling: SamplingConfig = setting(
        factory=SamplingConfig,
        help="how rollouts sample from the policy: temperature, top-p, top-k, min_new_tokens",
    )
    openai: OpenAIAgentConfig = setting(
        factory=OpenAIAgentConfig,
        help="agent=openai_agent: the user's OpenAI-client agent, run against the run's proxy",
    )

    def __post_init__(self) -> None:
        _at_least(self, "agent", 1, "max_assistant_turns", "max_turn_tokens", "max_response_tokens", "max_prompt_tokens",
                  "tool_concurrency", "max_tool_response_tokens", "max_consecutive_invalid_calls")
        _at_least(self, "agent", 0, "max_user_turns")
        _positive(self, "agent", "tool_timeout_s")


@dataclass
class ToolSpec:
    """One tool, in verl's YAML shape: class_name (registered name, module:Class or file.py:Class)."""

    class_name: str = setting("", "a registered tool, or module.Class / module:Class / file.py:Class")
    config: dict[str, Any] = setting(
        factory=dict, help="the tool's own settings, passed to its constructor (e.g. {type: native})")
    tool_schema: Optional[dict[str, Any]] = setting(
        None,
        "the OpenAI function schema shown to the model ({type: "
        "function, function: {name, ...}}); None: the class's default",
    )


@dataclass
class InteractionSpec:
    name: str = setting("", "the name a row selects it by (extra_info.interaction_kwargs.name)")
    class_name: str = setting(
        "",
        "a registered interaction, or module:Class / file.py:Class "
        "(empty: the interaction registered as `name`)",
    )
    config: dict[str, Any] = setting(
        factory=dict, help="the interaction's own settings, passed to its constructor")


@dataclass
class RewardConfig:
    path: Optional[str] = setting(None, "file.py holding a custom reward function")
    name: Optional[str] = setting(None, "function name in `path`, or a registered reward name")
    max_abs: float = setting(
        1e6,
        "largest |reward| an episode may have: a reward beyond it (from the function, or returned or set by "
        "an OpenAI-client agent) fails its episode, reported with its source, so no runaway value swamps a "
        "batch's advantages",
    )

    def __post_init__(self) -> None:
        _check(math.isfinite(self.max_abs) and self.max_abs > 0, "env.reward.max_abs",
               f"must be a finite number > 0, got {self.max_abs}")


@dataclass
class RetrieverConfig:
    url: Optional[str] = setting(None, "use a running retrieval server; otherwise the run starts one")
    corpus: Optional[str] = setting(None, "jsonl corpus; None: the env's synthetic corpus")
    topk: int = setting(3, "documents the search tool returns per query")
    method: Literal["bm25", "dense"] = setting(
        "bm25",
        "ranking of the server the run starts: bm25, or dense "
        "(all-MiniLM-L6-v2 embeddings); unused with url",
    )

    def __post_init__(self) -> None:
        _at_least(self, "env.retriever", 1, "topk")


@dataclass
class EnvConfig:
    name: str = setting("arithmetic", "a registered env")
    train_file: Optional[str] = setting(None, "verl-schema parquet; None: the env generates one")
    val_file: Optional[str] = setting(
        None, "held-out rows for evaluation, in train_file's schema; None: the env generates them")
    num_train: int = setting(2048, "rows the env generates when train_file is None")
    num_val: int = setting(64, "held-out rows the env generates when val_file is None")
    seed: int = setting(0, "seed of the rows the env generates (train and val)")
    difficulty: list[int] = setting(
        factory=lambda: [1, 2],
        help="arithmetic only: problem levels (1..4) of the generated rows, which cycle through them",
    )
    skip_bad_rows: bool = setting(
        False,
        "training rows that fail validation or whose prompt is over "
        "agent.max_prompt_tokens are skipped and counted (else: an error)",
    )
    tools: list[ToolSpec] = setting(
        factory=list,
        help="tools inline, in verl's shape (class_name, config, tool_schema); listed before tools_config's. "
             "The env preset's list yields to env.tools_config; one given in an override is kept",
    )
    tools_config: Optional[str] = setting(
        None, "a verl tool YAML file ({tools: [...]}): the whole tool set, as in verl (the env preset's tools "
        "are dropped)")
    interactions: list[InteractionSpec] = setting(
        factory=list,
        help="simulated users rows can select by name "
             "(extra_info.interaction_kwargs.name): name, class_name, config",
    )
    reward: RewardConfig = setting(
        factory=RewardConfig,
        help="the reward function: the env's own unless `name` (and `path`) name another",
    )
    retriever: RetrieverConfig = setting(
        factory=RetrieverConfig,
        help="search_r1's retrieval server: a running one (url), or one the run starts",
    )
    options: dict[str, Any] = setting(factory=dict, help="env-specific knobs")

    def __post_init__(self) -> None:
        _at_least(self, "env", 1, "num_train")
        _at_least(self, "env", 0, "num_val")


@dataclass
class CriticConfig:
    """The value model of adv_estimator=gae (PPO): on the learner ranks, or on ranks of its own."""

    placement: Literal["colocated", "separate"] = setting(
        "colocated",
        "colocated: sharded on the learner's ranks (no transfer; the step runs values, policy, critic in "
        "turn); separate: `ranks` processes of its own (FSDP2 over their own group): its update runs while "
        "the policy syncs weights and waits for the next batch",
    )
    ranks: int = setting(1, "placement=separate: the critic's ranks")
    path: Optional[str] = setting(
        None, "a causal-LM checkpoint whose trunk starts the critic (null: the policy's model)")
    lr: float = setting(1e-5, "AdamW learning rate of the critic")
    cliprange_value: float = setting(
        0.5, "clipped value loss: new values kept within this of the step's old values")
    warmup_steps: int = setting(
        0, "steps that train only the critic (the policy is not updated, its version kept)")
    gamma: float = setting(1.0, "GAE discount over generated tokens")
    lam: float = setting(0.95, "GAE lambda")
    whiten_advantages: bool = setting(True, "GAE advantages whitened over the batch's generated tokens")

    def __post_init__(self) -> None:
        _positive(self, "algorithm.critic", "lr")
        _at_least(self, "algorithm.critic", 1, "ranks")
        _check(math.isfinite(self.cliprange_value) and self.cliprange_value > 0, "algorithm.critic.cliprange_value",
               f"must be > 0, got {self.cliprange_value}")
        _at_least(self, "algorithm.critic", 0, "warmup_steps")
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            _check(0 <= v <= 1, f"algorithm.critic.{name}", f"must be in [0, 1], got {v}")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = setting(
        "grpo",
        'how rewards become advantages: grpo | drgrpo | rloo | reinforce_pp, or a registered "advantage" '
        "plugin; gae: PPO with a critic (algorithm.critic), per-token GAE over the generated tokens",
    )
    critic: CriticConfig = setting(
        factory=CriticConfig, help="the value model of adv_estimator=gae: placement, checkpoint, lr, GAE")
    turn_credit: bool = setting(
        False,
        "per-turn credit: turn and tool rewards join the final reward where they arose, and each token's "
        "advantage counts only the rewards from its turn on (asyncrl/learner/advantages.py); built-in "
        "estimators",
    )
    loss: str = setting(
        "ppo",
        'the policy loss: ppo | gspo | cispo | sapo | reinforce, or a registered "loss" plugin '
        "(asyncrl/learner/losses.py)",
    )
    norm_adv_by_std: bool = setting(
        True, "grpo: advantages divided by the group's reward std (false: only centred, as drgrpo)")
    n_samples: int = setting(4, "samples per prompt (group size)")
    max_staleness: int = setting(2, "eta: versions a trained token may lag the newest")
    dynamic_sampling: bool = setting(
        False, "DAPO's dynamic sampling: groups whose rewards are all equal (no gradient in a group-relative "
        "estimator) are closed unserved by the buffer and their starts draw fresh prompts (asyncrl/buffer/store.py)")
    dynamic_sampling_max_rounds: int = setting(
        3, "dynamic_sampling: at most this many x trainer.batch_groups such groups are closed between two "
        "batches; past that they are trained as they are (counted): a task all solved or all failed still trains")
    decoupled: bool = setting(True, "proximal forward: ratio against the learner's pre-step weights")
    clip_low: float = setting(0.2, "the ratio's lower clip bound is 1 - clip_low (ppo, gspo, cispo)")
    clip_high: float = setting(0.28, "... and its upper bound 1 + clip_high (clip-higher, as DAPO)")
    overlong: Literal["keep", "mask", "penalty"] = setting(
        "keep", "responses the token budget cut (finish_reason length): keep; mask (they train no token); or "
        "penalty (DAPO's soft overlong penalty on every response's reward: asyncrl/learner/overlong.py)")
    overlong_buffer_tokens: int = setting(
        0, "overlong=penalty: the penalty falls linearly over the last this many tokens of "
        "agent.max_response_tokens")
    overlong_penalty: float = setting(1.0, "overlong=penalty: the penalty at agent.max_response_tokens")
    clip_ratio_c: Optional[float] = setting(
        3.0, "dual clip (ppo; Ye et al. 2020, verl's clip_ratio_c): a token with A < 0 loses at most -A c, so a "
        "ratio above c gives it no gradient; null: off, else > 1")
    is_level: Literal["token", "sequence"] = setting(
        "token",
        "the behavior importance weight (truncation, rejection) "
        "per token, or one per sequence (is_seq_mode)",
    )
    is_threshold: Optional[float] = setting(
        2.0, "truncation of the behavior importance weight (null: none, e.g. IcePop)")
    is_reject_low: Optional[float] = setting(None, "reject (mask) tokens/sequences whose weight is below")
    is_reject_high: Optional[float] = setting(None, "... or above")
    is_seq_mode: Literal["sum", "mean"] = setting(
        "sum", "sequence-level log weight: sum of token log ratios, or their mean")
    sapo_tau_pos: float = setting(1.0, "loss=sapo: gate temperature for tokens with a positive advantage")
    sapo_tau_neg: float = setting(
        1.05, "... and for the others (higher: negative updates are damped faster off-policy)")
    allow_uncorrected_off_policy: bool = setting(
        False,
        "max_staleness > 0 with nothing correcting staleness (decoupled=false and a loss that ignores the "
        "ratio) is refused unless this is set",
    )
    kl_coef: float = setting(0.0, "weight of the KL to the frozen initial policy (0: no reference model)")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = setting(
        "k3", "how the per-token KL to the reference is estimated (asyncrl/learner/losses.py kl_penalty)")
    kl_in_reward: bool = setting(
        False, "the KL as a per-token reward penalty before GAE (adv_estimator=gae), not a loss term")
    entropy_coef: float = setting(0.0, "weight of the entropy bonus subtracted from the loss (0: none)")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"] = setting(
        "token_mean",
        "per-token losses averaged over all tokens, per sequence then over "
        "sequences, or summed / (sequences x agent.max_response_tokens) (Dr. GRPO)",
    )
    lr: float = setting(1e-6, "AdamW learning rate of the policy")
    weight_decay: float = setting(0.0, "AdamW weight decay of the policy")
    betas: list[float] = setting(
        factory=lambda: [0.9, 0.999], help="AdamW (beta1, beta2) of the policy and the critic")
    warmup_steps: int = setting(0, "optimizer steps of linear LR warmup (0: none)")
    lr_schedule: Literal["constant", "cosine"] = setting(
        "constant",
        "after warmup: constant, or cosine decay to lr x min_lr_ratio at the run's last optimizer step",
    )
    min_lr_ratio: float = setting(0.1, "lr_schedule=cosine: the final LR as a fraction of lr")
    grad_clip: float = setting(
        1.0, "gradient norm clipped to this at each optimizer step (policy and critic)")
    epochs: int = setting(1, "passes over each batch")
    minibatches: int = setting(1, "optimizer steps per pass")
    micro_batch_tokens: int = setting(4096, "token budget of one forward/backward")
    logits_chunk_tokens: int = setting(
        256,
        "the output head and log-softmax run on this many kept tokens at a time, each chunk recomputed in the "
        "backward pass: the learner's peak holds one chunk's full-vocabulary logits, not the micro-batch's "
        "(asyncrl/learner/head.py); 0: the whole micro-batch at once",
    )
    packing: bool = setting(
        True,
        "micro-batches pack sequences into rows (first fit, lengths summing "
        "to <= micro_batch_tokens); false: one padded row per sequence",
    )
    share_prompts: bool = setting(
        True,
        "packed micro-batches score the samples of one prompt as a tree: the prompt once, each response "
        "after it (asyncrl/learner/packing.py); needs sdpa or eager attention, else each sample pays its "
        "prompt",
    )
    max_nonfinite_steps: int = setting(
        3,
        "an optimizer step whose loss or grad norm is not finite is skipped (grads dropped, counted in "
        "learner/skipped_steps_nonfinite); this many in a row stop the run",
    )

    def __post_init__(self) -> None:
        _check(self.max_nonfinite_steps >= 1, "algorithm.max_nonfinite_steps",
               f"must be >= 1, got {self.max_nonfinite_steps}")
        _check(self.n_samples >= 1, "algorithm.n_samples", f"must be >= 1, got {self.n_samples}")
        _at_least(self, "algorithm", 1, "dynamic_sampling_max_rounds")
        _check(not (self.dynamic_sampling and self.n_samples < 2), "algorithm.dynamic_sampling",
               f"filters groups whose rewards are all equal, which needs groups of 2 or more: algorithm.n_samples="
               f"{self.n_samples}")
        _check(not self.turn_credit or self.adv_estimator in ("grpo", "drgrpo", "rloo", "reinforce_pp"),
               "algorithm.turn_credit", "works with the built-in estimators grpo, drgrpo, rloo, reinforce_pp "
               "(their per-token form is documented; gae always places turn and tool rewards), not "
               f"adv_estimator={self.adv_estimator!r}")
        _check(self.n_samples >= 2 or self.adv_estimator not in GROUP_ESTIMATORS, "algorithm.n_samples",
               f"must be >= 2 with adv_estimator={self.adv_estimator} (its baseline is the group of samples "
               f"of one prompt; a group of 1 has advantage 0 and learns nothing), got {self.n_samples}")
        _check(self.max_staleness >= 0, "algorithm.max_staleness", f"must be >= 0, got {self.max_staleness}")
        _check(self.clip_low >= 0 and self.clip_high >= 0, "algorithm.clip_low/clip_high", "must be >= 0")
        if self.overlong == "penalty":
            _check(self.overlong_buffer_tokens > 0, "algorithm.overlong_buffer_tokens",
                   f"overlong=penalty needs a buffer > 0 tokens, got {self.overlong_buffer_tokens}")
            _check(math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0, "algorithm.overlong_penalty",
                   f"must be a finite number >= 0, got {self.overlong_penalty}")
        _check(self.clip_ratio_c is None or (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1),
               "algorithm.clip_ratio_c", f"must be null (off) or a finite number > 1, got {self.clip_ratio_c}")
        _check(self.is_threshold is None or self.is_threshold > 0, "algorithm.is_threshold",
               f"must be > 0 (or null: no truncation), got {self.is_threshold}")
        _check(self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0, "algorithm.sapo_tau_pos/sapo_tau_neg",
               f"must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        for name in ("is_reject_low", "is_reject_high"):
            v = getattr(self, name)
            _check(v is None or (math.isfinite(v) and v >= 0), f"algorithm.{name}", f"must be >= 0 or null, got {v}")
        _check(self.is_reject_low is None or self.is_reject_high is None or self.is_reject_low < self.is_reject_high,
               "algorithm.is_reject_low/is_reject_high",
               f"low must be below high, got {self.is_reject_low} and {self.is_reject_high}")
        _check(self.lr > 0, "algorithm.lr", f"must be > 0, got {self.lr}")
        _check(len(self.betas) == 2, "algorithm.betas", f"must hold 2 values, got {self.betas}")
        _check(self.minibatches >= 1 and self.epochs >= 1, "algorithm.epochs/minibatches", "must be >= 1")
        _at_least(self, "algorithm", 1, "micro_batch_tokens")
        _at_least(self, "algorithm", 0, "logits_chunk_tokens")
        _at_least(self, "algorithm", 0, "warmup_steps")
        _positive(self, "algorithm", "grad_clip")
        _check(0 <= self.min_lr_ratio <= 1, "algorithm.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.kl_coef >= 0 and self.weight_decay >= 0, "algorithm.kl_coef/weight_decay", "must be >= 0")
        _check(not self.kl_in_reward or (self.adv_estimator == "gae" and self.kl_coef > 0), "algorithm.kl_in_reward",
               "needs adv_estimator=gae (per-token rewards) and kl_coef > 0 (the penalty's weight), got "
               f"adv_estimator={self.adv_estimator!r}, kl_coef={self.kl_coef}")


@dataclass
class WeightSyncConfig:
    transport: Literal["auto", "gloo", "nccl", "tensor", "disk"] = setting(
        "auto",
        "how weights reach the engines: gloo / nccl (a process group), tensor (CUDA "
        "IPC), disk (files); auto: gloo on CPU, tensor with one GPU, else nccl",
    )
    bucket_mb: int = setting(256, "weights are gathered and sent in buckets of at most this many MiB")
    timeout_s: float = setting(
        120.0,
        "seconds each step of a sync (an engine call, a transfer) may take; an engine past it is left out",
    )
    mode: Literal["in_place", "abort"] = setting(
        "in_place",
        "in_place: generations in flight pause and go on with the new weights; "
        "abort: they are aborted and continued from their partial output",
    )
    disk_dir: Optional[str] = setting(
        None, "transport=disk: where the weight files are written (None: <run dir>/weight_sync)")
    verify_every: int = setting(
        1, "every this many syncs, one tensor (rotating) is read back from each engine and must equal what "
        "was sent (GET /get_weights_by_name; one call per engine); 0: never. Names are checked before an "
        "engine's first sync whatever this says")
    delta: Literal["auto", "on", "off"] = setting(
        "auto", "gloo/nccl to asyncrl's engines serving bf16/fp16: after the first sync only the values that changed "
        "since the engines' last version travel (bit-exact, checksummed; docs/design.md \"Delta weight sync\"), at "
        "the cost of one copy of the model in the engines' dtype on learner rank 0. auto: on when an engine is on "
        "another host (over loopback, finding the changes costs more than moving the bytes: docs/benchmarks.md). "
        "SGLang always gets whole tensors")

    def __post_init__(self) -> None:
        _at_least(self, "trainer.weight_sync", 1, "bucket_mb")
        _at_least(self, "trainer.weight_sync", 0, "verify_every")
        _positive(self, "trainer.weight_sync", "timeout_s")


@dataclass
class TrainerConfig:
    mode: Literal["async", "sync"] = setting(
        "async", "sync: rollout waits for each weight sync (max_staleness 0)")
    total_steps: int = setting(20, "training steps (policy versions) of the run")
    max_minutes: float = setting(
        0.0,
        "a wall-clock budget: no step starts once the run (warm start included) is this many minutes old; "
        "the run then ends as at total_steps (checkpoint, final/) and its summary says so. 0: no budget",
    )
    batch_groups: int = setting(4, "prompts (groups) per training step")
    rollout_workers: int = setting(1, "Ray actors running agent loops")
    episodes_per_worker: int = setting(16, "concurrent agent loops per rollout worker")
    max_inflight_generations: int = setting(16, "engine slots across the rollout side")
    learner_ranks: int = setting(1, "FSDP2 ranks of the learner")
    # asyncrl/run_dir.py owns the rule for the run's directory, the lock and what a start finds there
    run_name: Optional[str] = setting(None, "the run's dir is outputs/<run_name> (None: the start time)")
    output_dir: Optional[str] = setting(None, "the run's dir, whatever run_name says")
    checkpoint_every: int = setting(0, "steps; 0: only at the end")
    keep_checkpoints: int = setting(2, "newest checkpoints kept; older ones are deleted")
    resume: Literal["off", "auto"] = setting(
        "off", "auto: the newest checkpoint of the run dir, or a fresh start saying so")
    eval_every: int = setting(0, "steps; 0: no evaluation")
    eval_pass_k: int = setting(1, "samples per evaluation prompt (reported as eval/pass@k)")
    eval_samples: int = setting(32, "evaluation prompts: the first this many validation rows")
    wandb: Literal["off", "offline", "online"] = setting(
        "offline", "offline: logged under the run dir, `wandb sync` later")
    wandb_project: str = setting("asyncrl", "the wandb project the run is logged to")
    dump_trajectories: float = setting(
        1.0, "fraction of the trajectories the buffer stored written to trajectories-w<k>.jsonl (picked by uid and "
        "seed; the learner writes the same ones' log-probs to learner_logprobs.jsonl)")
    progress: bool = setting(
        True, "on a terminal, one progress line rewritten in place (false, or no terminal: plain lines)")
    weight_sync: WeightSyncConfig = setting(
        factory=WeightSyncConfig, help="how the learner's weights reach the engines after each step")
    max_prompt_retries: int = setting(
        2, "re-issues of a prompt whose group the buffer dropped unserved; then skipped")
    stall_timeout_s: float = setting(
        1800.0, "watchdog: stop (exit 4) when no step was trained for this long; 0: off")
    memory_stop_fraction: float = setting(
        0.9,
        "stop (exit 4), naming the process and what it held, when the machine's memory (a container's limit "
        "where set) is this full: checked by the driver while it waits and by the learner before each "
        "micro-batch, before Ray's memory monitor (0.95) kills workers without a word of why; 1: never",
    )
    learner_memory_gb: float = setting(
        0.0,
        "one learner rank's step budget in GiB (0: none): before anything starts, algorithm.micro_batch_tokens "
        "is lowered to the largest multiple of 256 whose step is estimated to fit (asyncrl/learner/"
        "memory_estimate.py; where the learner runs on this machine's CPU), and a run whose one longest "
        "sequence cannot fit is refused",
    )
    max_failed_episode_fraction: float = setting(
        0.9, "watchdog: stop (exit 4) when more of the recent episodes failed")
    failed_episode_window: int = setting(
        64, "... the last episodes each rollout worker keeps; judged once this many exist")
    learner_timeout_s: float = setting(
        900.0,
        "a learner or critic rank blocked this long in a collective (a peer died or hangs) fails, and the "
        "driver waits at most this long past a call's own time for every rank's answer: a stopped or "
        "wedged rank stops the run, named",
    )

    def __post_init__(self) -> None:
        _check(0 < self.memory_stop_fraction <= 1, "trainer.memory_stop_fraction",
               f"must be in (0, 1], got {self.memory_stop_fraction}")
        _check(self.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {self.total_steps}")
        _check(math.isfinite(self.learner_memory_gb) and self.learner_memory_gb >= 0, "trainer.learner_memory_gb",
               f"must be a finite number of GiB >= 0 (0: no budget), got {self.learner_memory_gb}")
        _check(math.isfinite(self.max_minutes) and self.max_minutes >= 0, "trainer.max_minutes",
               f"must be a finite number of minutes >= 0 (0: no budget), got {self.max_minutes}")
        if self.run_name is not None:
            try:
                check_run_name(self.run_name)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        _check(self.resume != "auto" or self.run_name is not None or bool(self.output_dir), "trainer.resume",
               "auto resumes the run dir's newest checkpoint, but the default dir outputs/<start time> is new on "
               "every start and can never hold one: name the run (trainer.run_name=NAME, dir outputs/NAME) and use "
               "the same name to resume it, or give trainer.output_dir=DIR")
        _check(self.learner_timeout_s > 0, "trainer.learner_timeout_s", f"must be > 0, got {self.learner_timeout_s}")
        _check(self.batch_groups >= 1, "trainer.batch_groups", f"must be >= 1, got {self.batch_groups}")
        _check(0.0 <= self.dump_trajectories <= 1.0, "trainer.dump_trajectories", "must be in [0, 1]")
        _check(self.max_prompt_retries >= 0, "trainer.max_prompt_retries", f"must be >= 0, got {self.max_prompt_retries}")
        _check(self.stall_timeout_s >= 0, "trainer.stall_timeout_s", f"must be >= 0 (0: off), got {self.stall_timeout_s}")
        _check(0.0 < self.max_failed_episode_fraction <= 1.0, "trainer.max_failed_episode_fraction",
               f"must be in (0, 1] (1: off), got {self.max_failed_episode_fraction}")
        _check(self.failed_episode_window >= 1, "trainer.failed_episode_window",
               f"must be >= 1, got {self.failed_episode_window}")
        _at_least(self, "trainer", 1, "rollout_workers", "episodes_per_worker", "max_inflight_generations",
                  "learner_ranks", "keep_checkpoints", "eval_pass_k", "eval_samples")
        _at_least(self, "trainer", 0, "checkpoint_every", "eval_every")


@dataclass
class BufferConfig:
    host: str = setting(
        "127.0.0.1", "the address the buffer binds; a non-loopback one needs CURVE (buffer.curve)")
    port: int = setting(0, "0: pick a free port")
    wal_dir: Optional[str] = setting(None, "None: <output_dir>/buffer")
    fsync: Literal["each", "batched", "off"] = setting(
        "batched",
        "WAL durability: fsync after each record, once per round of records (group "
        "commit), or never (survives a killed process, not a machine crash)",
    )
    capacity_trajectories: int = setting(
        100_000,
        "trajectories held at most; past it a PUT is answered "
        "busy (a group already begun still takes members)",
    )
    capacity_bytes: int = setting(4 << 30, "... and bytes of trajectories held at most")
    order: Literal["oldest", "newest"] = setting(
        "oldest",
        "complete groups served oldest first (by their oldest member's policy version), or newest first",
    )
    max_frame_bytes: int = setting(
        256 << 20, "the largest request body accepted (bytes); a larger one gets an error reply")
    curve: Literal["off", "on", "auto"] = setting(
        "on",
        "CURVE + a ZAP allow-list of the run's producer and consumer keys (asyncrl/buffer/keys.py), so no other "
        "process can add, take or read trajectories; auto: on only for a non-loopback bind; off: any local "
        "process can talk to a loopback buffer",
    )
    keys_dir: Optional[str] = setting(
        None, "0700 dir of z85 key files (created when absent); None: fresh keys in memory for each run")
    compact_min_bytes: int = setting(
        64 << 20,
        "online WAL compaction when the log exceeds max(compact_min_bytes, compact_ratio x the live state) "
        "(asyncrl.buffer.wal.should_compact)",
    )
    compact_ratio: float = setting(
        4.0, "... and the factor of that rule: the log must exceed this x the live state (>= 2)")
    disk_reserve_bytes: int = setting(
        64 << 20,
        "disk full: this much is preallocated beside the log and released when a write finds the disk full, "
        "so serving and committing still log while PUTs are refused; acking resumes when space returns",
    )
    disk_probe_s: float = setting(1.0, "while the disk is full: how often to check whether space returned")
    dedupe_other_max: int = setting(
        1_000_000,
        "dedupe of uids that are not training uids (<run_id>-g<pos>[r<k>]-<i>): remembered exactly, at most "
        "this many",
    )

    def __post_init__(self) -> None:
        _at_least(self, "buffer", 1, "capacity_trajectories", "capacity_bytes", "max_frame_bytes", "compact_min_bytes",
                  "dedupe_other_max")
        _check(self.compact_ratio >= 2, "buffer.compact_ratio",
               f"must be >= 2 (a compacted log must not qualify for compaction again at once), got {self.compact_ratio}")
        _check(self.disk_reserve_bytes >= 0, "buffer.disk_reserve_bytes", f"must be >= 0, got {self.disk_reserve_bytes}")
        _check(self.disk_probe_s > 0, "buffer.disk_probe_s", f"must be > 0, got {self.disk_probe_s}")
        _check(0 <= self.port <= 65535, "buffer.port", f"must be in [0, 65535], got {self.port}")


@dataclass
class RewardModelConfig:
    """A reward model scoring finished episodes on the rollout side, before they enter the buffer
    (asyncrl/rollout/reward_model.py). reward = rule_weight * (the env's reward) + weight * (the model's)."""

    kind: Literal["none", "discriminative", "generative"] = setting(
        "none",
        "none: no reward model; discriminative: a classifier "
        "on its own worker; generative: the run's engine as a judge",
    )
    path: Optional[str] = setting(
        None,
        "discriminative: a sequence-classification checkpoint (one label: its logit is the score), on its "
        "own worker",
    )
    batch_size: int = setting(
        8, "discriminative: texts per forward (requests of all rollout workers are batched)")
    max_wait_ms: float = setting(20.0, "... how long a partial batch waits for more requests")
    max_length: int = setting(2048, "... tokens per text (longer texts keep their end)")
    template: str = setting(
        "Rate the response to the request from 0 (wrong) to 9 (right).\nRequest: {prompt}\n"
                     "Response: {response}\nReply with one digit.",
        "generative: a prompt sent to the run's engine; {prompt}, {response} and {ground_truth} are filled "
        "in",
    )
    pattern: str = setting(r"(\d+(?:\.\d+)?)", "the first match's group 1 is the verdict")
    scale: float = setting(9.0, "verdict / scale is the score")
    max_new_tokens: int = setting(16, "generative: tokens of the judge's (greedy) reply at most")
    weight: float = setting(1.0, "the model's score's weight in the reward")
    rule_weight: float = setting(1.0, "the env reward function's weight in the reward")
    on_failure: Literal["zero", "fail_episode"] = setting("zero", "a verdict that cannot be had or parsed")
    timeout_s: float = setting(60.0, "seconds one episode's verdict may take; then on_failure applies")

    def __post_init__(self) -> None:
        _check(self.kind != "discriminative" or bool(self.path), "reward_model.path",
               "a discriminative reward model needs the path of a sequence-classification checkpoint")
        _at_least(self, "reward_model", 1, "batch_size", "max_length", "max_new_tokens")
        for name in ("max_wait_ms", "weight", "rule_weight", "scale", "timeout_s"):
            v = getattr(self, name)
            _check(math.isfinite(v), f"reward_model.{name}", f"must be a finite number, got {v}")
        _check(self.max_wait_ms >= 0 and self.timeout_s > 0 and self.scale != 0, "reward_model",
               "max_wait_ms must be >= 0, timeout_s > 0, scale non-zero")
        if self.kind == "generative":
            try:
                groups = re.compile(self.pattern).groups
            except re.error as e:
                raise ConfigError(f"reward_model.pattern: not a regular expression ({e}): {self.pattern!r}") from None
            _check(groups >= 1, "reward_model.pattern", f"needs a group for the verdict, got {self.pattern!r}")
            for key in ("{response}",):
                _check(key in self.template, "reward_model.template", f"must contain {key}")


@dataclass
class WarmStartConfig:
    """A supervised warm start inside `asyncrl train` (asyncrl/sft/warm_start.py): demonstrations of the first
    `demos` training rows, SFT on them with the RL learner, then RL from that model."""

    mode: Literal["off", "auto", "on"] = setting(
        "off",
        "off: RL starts from the model as configured; on: always (the preflight refuses an env or agent "
        "that cannot demonstrate); auto: when they can and model.path is unset (a preset's base model), "
        "else off (said once)",
    )
    demos: int = setting(384, "demonstrations (of the first this many training rows)")
    epochs: int = setting(1, "passes over the demonstrations")
    batch: int = setting(8, "demonstrations per SFT optimizer step")
    lr: float = setting(1.0e-5, "SFT's learning rate (RL's is algorithm.lr)")

    def __post_init__(self) -> None:
        _at_least(self, "warm_start", 1, "demos", "epochs", "batch")
        _check(math.isfinite(self.lr) and self.lr > 0, "warm_start.lr", f"must be a positive number, got {self.lr}")


@dataclass
class PlacementConfig:
    """Which nodes host each role: the Ray resources one actor of the role asks for (asyncrl/run/placement.py).
    A node offers a custom resource when started with it (`ray start --resources='{"engines": 4}'`)."""

    engine: dict[str, float] = setting(
        factory=dict, help='each engine actor, e.g. {engine_node: 1} or {GPU: 1}; its server runs on that node')
    learner: dict[str, float] = setting(factory=dict, help="each learner (and critic) rank; ranks may span nodes")
    rollout: dict[str, float] = setting(factory=dict, help="each rollout worker (its agent loops and sandboxes)")
    buffer: dict[str, float] = setting(factory=dict, help="the replay buffer (its log is written on that node)")

    def __post_init__(self) -> None:
        for role in PLACED_ROLES:
            for name, amount in getattr(self, role).items():
                key = f"ray.placement.{role}.{name}"
                _check(isinstance(name, str) and bool(name), f"ray.placement.{role}", f"a resource needs a name, got {name!r}")
                _check(not isinstance(amount, bool) and isinstance(amount, (int, float)) and math.isfinite(amount)
                       and amount > 0, key, f"must be a positive number, got {amount!r}")


PLACED_ROLES = tuple(f.name for f in dataclasses.fields(PlacementConfig))  # engine, learner, rollout, buffer


@dataclass
class RayConfig:
    address: Optional[str] = setting(None, 'None: start a local instance; "auto": join a cluster')
    num_cpus: Optional[int] = setting(
        None, "CPUs of a local instance (None: all of the machine's); leave None to join a cluster")
    placement: PlacementConfig = setting(
        factory=PlacementConfig, help="which nodes host engines, learner ranks, rollout workers and the buffer")
    place_timeout_s: float = setting(
        120.0, "seconds a replacement actor (an engine or rollout worker whose node was lost) may wait for a node "
        "that can host it before the run stops naming what is missing")

    def __post_init__(self) -> None:
        _check(self.num_cpus is None or self.num_cpus >= 1, "ray.num_cpus", f"must be >= 1, got {self.num_cpus}")
        _check(self.address is None or self.num_cpus is None, "ray.num_cpus",
               f"sizes a local instance only; with ray.address={self.address!r} the cluster's nodes say their CPUs")
        _positive(self, "ray", "place_timeout_s")


@dataclass
class Config:
    model: ModelConfig = setting(factory=ModelConfig, help="the policy model: which, its precision, LoRA")
    engine: EngineConfig = setting(
        factory=EngineConfig,
        help="the inference servers: which kind, how many, where, their batch, timeouts and liveness",
    )
    agent: AgentConfig = setting(
        factory=AgentConfig, help="the agent loop: its turn and token budgets, tool calls, sampling")
    env: EnvConfig = setting(factory=EnvConfig, help="the task: its rows, tools, interactions and reward")
    algorithm: AlgorithmConfig = setting(
        factory=AlgorithmConfig,
        help="advantages, the policy loss and its off-policy correction, KL, the optimizer",
    )
    trainer: TrainerConfig = setting(
        factory=TrainerConfig,
        help="the run: steps, workers, learner ranks, its dir, "
             "checkpoints, evaluation, logging, weight sync",
    )
    buffer: BufferConfig = setting(
        factory=BufferConfig,
        help="the replay buffer between rollout and learner: its address, WAL and capacity",
    )
    ray: RayConfig = setting(factory=RayConfig, help="the Ray instance the run starts or joins")
    reward_model: RewardModelConfig = setting(
        factory=RewardModelConfig,
        help="an optional reward model scoring episodes before the buffer (kind=none: off)",
    )
    warm_start: WarmStartConfig = setting(
        factory=WarmStartConfig, help="an optional supervised warm start before RL (mode=off: none)")
    plugins: list[str] = setting(factory=list, help="module paths or .py files to import")
    seed: int = setting(
        0,
        "the run's seed: the prompt order (each epoch's shuffle), every episode's sampling seed "
        "(asyncrl/util/seeds.py), which trajectories are dumped, the warm start's SFT batches",
    )

    def __post_init__(self) -> None:
        if self.trainer.mode == "sync" and self.algorithm.max_staleness != 0:  # the one place sync means eta 0
            self.algorithm = dataclasses.replace(self.algorithm, max_staleness=0)
        a = self.algorithm
        _check(a.overlong != "penalty" or a.overlong_buffer_tokens < self.agent.max_response_tokens,
               "algorithm.overlong_buffer_tokens", f"{a.overlong_buffer_tokens} must be below "
               f"agent.max_response_tokens={self.agent.max_response_tokens} (the penalty starts that many tokens "
               "before the budget ends)")
        longest = self.agent.max_prompt_tokens + self.agent.max_response_tokens
        _check(self.engine.type != "embedded" or longest <= self.engine.max_running_tokens, "engine.max_running_tokens",
               f"{self.engine.max_running_tokens} is less than agent.max_prompt_tokens + agent.max_response_tokens = "
               f"{longest}: the embedded engine could not hold the longest episode allowed")
        # SGLang reports the logprob after its min_new_tokens ban on stop tokens (renormalized), the
        # learner before it (asyncrl/engine/sampling.py): the importance ratios would be wrong
        min_new = self.agent.sampling.min_new_tokens
        dp = sglang_dp_size(self.engine.extra_args) if self.engine.type == "sglang" else 1
        _check(dp == 1, "engine.extra_args",
               f"data-parallel size {dp}: SGLang's weight-update routes take one data-parallel replica only (they "
               "assert dp_size == 1 and answer HTTP 500); run engine.num_engines engines instead of --dp-size")
        _check(not (self.engine.type == "sglang" and min_new > 0), "agent.sampling.min_new_tokens",
               f"{min_new} with engine.type=sglang: SGLang reports the logprob after its min_new_tokens ban "
               "on stop tokens, asyncrl's learner before it, so the importance ratios would be wrong; set "
               "agent.sampling.min_new_tokens=0 or use engine.type=embedded")


# ----------------------------------------------------------------------------- conversion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if origin is Literal:
        choices = typing.get_args(tp)
        _check(value in choices, where, f"{value!r} is not one of {list(choices)}")
        return value
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), where, f"expected a mapping, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, where)
    if origin is list:
        _check(isinstance(value, (list, tuple)), where, f"expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _check(isinstance(value, dict), where, f"expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        _check(isinstance(value, bool), where, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), where, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok, where, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), where, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported schema type {_type_name(tp)}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            scope = f"under {where!r}" if where else "at the top level"
            raise ConfigError(f"unknown key {path!r}{hint}; valid keys {scope}: {', '.join(names)}")
        kwargs[key] = _convert(hints[key], value, path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"{where or 'config'}: {e}") from e


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------- loading


def compose(overrides: list[str] | None = None, config_name: str = "config") -> dict:
    """Compose the Hydra tree with `overrides` and return a resolved plain dict (not yet validated)."""
    # lazy: imports hydra, omegaconf, which this module does not load otherwise
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    _store_schema_defaults()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
            out = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain_hydra_error(str(e), overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    out.pop("hydra", None)
    return out


def _store_schema_defaults() -> None:
    """Every schema key with its default, as the first entry of config.yaml's defaults list: the
    YAML files then only say what differs, and any schema key can be overridden without `+`."""
    # lazy: imports hydra, omegaconf, which this module does not load otherwise
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="asyncrl_defaults", node=OmegaConf.create(to_dict(Config())))


def _explain_hydra_error(message: str, overrides: list[str]) -> str:
    """Turn Hydra's errors into one line naming the override at fault and the valid choices: an
    unknown option of a config group (`env=nonexistent`), or a key not in the schema (`algoritm.lr=1`)."""
    bad_options = [m for m in map(_bad_group_option, overrides) if m]
    if bad_options:
        return "; ".join(bad_options)
    top = [f.name for f in dataclasses.fields(Config)]
    for ov in overrides:
        key = ov.lstrip("+~").split("=", 1)[0]
        mapping = _mapping_field(key)
        if mapping and not ov.startswith("+") and "use +" in message and f"'{key}'" in message:
            return (f"override {ov!r}: {mapping} is a mapping that the config leaves empty; add to it with a "
                    f"leading '+': '+{ov.lstrip('~')}'")
        head = key.split(".", 1)[0]
        if not key or "." not in key and group_options(head) is not None:
            continue  # a group selection, not a key: only `_bad_group_option` speaks about those
        if f"'{key}'" in message or f"'{head}'" in message:
            if head not in top:
                close = difflib.get_close_matches(head, top, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                return f"unknown key {head!r} in override {ov!r}{hint}; valid top-level keys: {', '.join(top)}"
            sub = _section_fields(head, key)
            if sub is not None:
                return f"unknown key {key!r} in override {ov!r}; valid keys under {key.rsplit('.', 1)[0]!r}: {', '.join(sub)}"
    return " ".join(message.split("Config search path:")[0].split())


def group_options(group: str) -> Optional[list[str]]:
    """The options of config group `group` (configs/<group>/*.yaml), or None when it is not a group."""
    d = config_dir() / group
    return sorted(p.stem for p in d.glob("*.yaml")) if group and d.is_dir() else None


def _bad_group_option(override: str) -> Optional[str]:
    """`env=nonexistent` -> a message listing the group's options; None for anything else."""
    key, sep, value = override.lstrip("+~").partition("=")
    options = group_options(key) if sep and "." not in key and "/" not in key else None
    if options is None or value in options:
        return None
    close = difflib.get_close_matches(value, options, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key}={value}: no such option in config group {key!r}{hint}; available: {', '.join(options)}"


def _mapping_field(key: str) -> Optional[str]:
    """The dotted name of the schema's mapping (a dict field) that `key` is or lies under, else None."""
    cls: Any = Config
    parts = key.split(".")
    for i, p in enumerate(parts):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if p not in hints:
            return None
        if typing.get_origin(hints[p]) is dict:
            return ".".join(parts[: i + 1])
        cls = hints[p]
    return None


def _section_fields(head: str, key: str) -> Optional[list[str]]:
    cls: Any = Config
    parts = key.split(".")[:-1]
    for p in parts:
        hints = typing.get_type_hints(cls)
        if p not in hints or not dataclasses.is_dataclass(hints[p]):
            return None
        cls = hints[p]
    return [f.name for f in dataclasses.fields(cls)]


def load_config(overrides: list[str] | None = None) -> Config:
    """Compose, resolve and validate the configuration. Raises ConfigError with a precise message."""
    return from_dict(Config, tool_yaml_is_the_tool_set(compose(overrides), overrides or []))


def tool_yaml_is_the_tool_set(tree: dict, overrides: list[str]) -> dict:
    """With `env.tools_config` set, the YAML is the whole tool set, as in verl: the env preset's own
    `env.tools` (configs/env/*.yaml: env=gsm8k's calculator, env=search_r1's search) are dropped, so a verl
    YAML loads unchanged instead of colliding with them or adding a tool the user never configured.
    `env.tools` given in an override as well is the user's own choice: both load, inline first."""
    env = tree.get("env")
    if not isinstance(env, dict) or not env.get("tools_config"):
        return tree
    keys = {ov.lstrip("+~").split("=", 1)[0] for ov in overrides}
    if not any(k == "env.tools" or k.startswith(("env.tools.", "env.tools[")) for k in keys):
        env["tools"] = []
    return tree
