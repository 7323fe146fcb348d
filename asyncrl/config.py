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
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from asyncrl.run_dir import check_run_name


def config_dir() -> Path:
    """The Hydra tree shipped as the `asyncrl.configs` package (the repo's configs/ when editable)."""
    import importlib.util

    spec = importlib.util.find_spec("asyncrl.configs")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the asyncrl.configs package is missing: reinstall asyncrl (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations)))


class ConfigError(ValueError):
    """A configuration value is missing, misspelled, of the wrong type or out of range."""


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


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
    rank: int = 0  # LoRA adapters of this rank on the target layers (asyncrl/learner/lora.py); 0: full fine-tuning
    alpha: float = 16.0  # the adapter's scale is alpha / rank
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # linear layers, by name
    seed: int = 0  # the adapters' initialisation (every rank builds the same)

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "model.lora.rank", f"must be >= 0, got {self.rank}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(bool(self.target_modules), "model.lora.target_modules", "must name at least one layer")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # a known default model, or "custom" with `path`
    path: Optional[str] = None  # a local HF checkpoint dir, or a hub id (org/name) in the local HF cache; overrides `name`
    allow_download: bool = False  # a hub id missing from the local HF cache is downloaded (else: an error)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    attn_implementation: Optional[str] = None  # None: sdpa (flash_attention_2 on GPU when installed)
    gradient_checkpointing: bool = False
    cache_dir: Optional[str] = None  # where the default model's safetensors copy is cached
    lora: LoraConfig = field(default_factory=LoraConfig)
    # the learner's forward and backward under bf16 autocast on a CPU with native bf16 (avx512_bf16 or amx_bf16;
    # elsewhere fp32, said once); master weights and optimizer state stay fp32. GPUs always compute in bf16.
    cpu_bf16: bool = False

    def __post_init__(self) -> None:
        if self.name == "custom" and not self.path:
            raise ConfigError("model=custom needs model.path (a local Hugging Face checkpoint directory)")


@dataclass
class EngineConfig:
    type: Literal["embedded", "sglang"] = "embedded"  # embedded: asyncrl's engine (any device); sglang: GPU
    num_engines: int = 1  # inference servers launched (each serves the whole model)
    urls: list[str] = field(default_factory=list)  # attach to running servers instead of launching
    host: str = "127.0.0.1"
    device: Optional[str] = None  # None: cuda if available else cpu
    # auto: bf16 on a GPU and on a CPU with native bf16 (avx512_bf16 / amx_bf16), fp32 on other CPUs
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_running_seqs: int = 16
    max_running_tokens: int = 16384
    launch_timeout_s: float = 300.0
    # A client gives up on an engine that accepts connections but never answers after
    # (max_retries + 1) x request_timeout_s + backoff = 3 x 180 s = 9 min (refused connections fail in
    # under 2 s); a supervised engine that hangs is killed by the liveness probe long before that.
    request_timeout_s: float = 180.0
    max_retries: int = 2
    # Liveness of launched engines: a one-token /generate under probe_timeout_s each supervisor check;
    # probe_failures in a row (not counting while the engine reports itself paused for a weight sync)
    # and the engine's process group is SIGKILLed and relaunched: about 3 x (20 s + 5 s) ~ 75 s.
    probe_timeout_s: float = 20.0
    probe_failures: int = 3
    mem_fraction_static: float = 0.4  # sglang only
    extra_args: list[str] = field(default_factory=list)  # sglang only, passed to launch_server

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
    temperature: float = 1.0  # sampling temperature of rollouts (the learner divides logits by it too)
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "agent.sampling.temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "agent.sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "agent.sampling.top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _at_least(self, "agent.sampling", 0, "min_new_tokens")


@dataclass
class OpenAIAgentConfig:
    """agent=openai_agent: the user's OpenAI-client agent, run per episode against the proxy (asyncrl/proxy)."""

    function: Optional[str] = None  # a registered openai_agent_fn, or module:fn / file.py:fn
    command: Optional[list[str]] = None  # else an external command (OPENAI_BASE_URL, OPENAI_API_KEY, sample on stdin)
    timeout_s: float = 600.0  # one episode's wall clock; the command's process group is killed after it
    turn_discount: float = 1.0  # a split call's reward: episode reward x discount ** (calls after it)
    model_name: str = "asyncrl-policy"  # what GET /v1/models lists

    def __post_init__(self) -> None:
        _positive(self, "agent.openai", "timeout_s")
        _check(0.0 < self.turn_discount <= 1.0, "agent.openai.turn_discount", f"must be in (0, 1], got {self.turn_discount}")


@dataclass
class AgentConfig:
    name: str = "tool_agent"  # a registered agent loop
    max_assistant_turns: int = 4
    max_user_turns: int = 2
    max_turn_tokens: int = 256  # budget of one generation
    max_response_tokens: int = 768  # budget of the whole trajectory after the prompt
    max_prompt_tokens: int = 512
    tool_parser: str = "hermes"  # how tool calls are read from the text (asyncrl plugins lists them; auto: from the chat template)
    tool_concurrency: int = 4
    tool_timeout_s: float = 30.0
    max_tool_response_tokens: int = 256
    max_consecutive_invalid_calls: int = 3
    system_prompt: Optional[str] = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    openai: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)

    def __post_init__(self) -> None:
        _at_least(self, "agent", 1, "max_assistant_turns", "max_turn_tokens", "max_response_tokens", "max_prompt_tokens",
                  "tool_concurrency", "max_tool_response_tokens", "max_consecutive_invalid_calls")
        _at_least(self, "agent", 0, "max_user_turns")
        _positive(self, "agent", "tool_timeout_s")


@dataclass
class ToolSpec:
    """One tool, in verl's YAML shape: class_name (registered name, module:Class or file.py:Class)."""

    class_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    tool_schema: Optional[dict[str, Any]] = None


@dataclass
class InteractionSpec:
    name: str = ""
    class_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    path: Optional[str] = None  # file.py holding a custom reward function
    name: Optional[str] = None  # function name in `path`, or a registered reward name


@dataclass
class RetrieverConfig:
    url: Optional[str] = None  # use a running retrieval server; otherwise the run starts one
    corpus: Optional[str] = None  # jsonl corpus; None: the env's synthetic corpus
    topk: int = 3
    method: Literal["bm25", "dense"] = "bm25"

    def __post_init__(self) -> None:
        _at_least(self, "env.retriever", 1, "topk")


@dataclass
class EnvConfig:
    name: str = "arithmetic"  # a registered env
    train_file: Optional[str] = None  # verl-schema parquet; None: the env generates one
    val_file: Optional[str] = None
    num_train: int = 2048  # rows the env generates when train_file is None
    num_val: int = 64  # held-out rows the env generates when val_file is None
    seed: int = 0
    difficulty: list[int] = field(default_factory=lambda: [1, 2])
    skip_bad_rows: bool = False
    tools: list[ToolSpec] = field(default_factory=list)
    tools_config: Optional[str] = None  # a verl tool YAML file: {tools: [...]}
    interactions: list[InteractionSpec] = field(default_factory=list)
    reward: RewardConfig = field(default_factory=RewardConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    options: dict[str, Any] = field(default_factory=dict)  # env-specific knobs

    def __post_init__(self) -> None:
        _at_least(self, "env", 1, "num_train")
        _at_least(self, "env", 0, "num_val")


@dataclass
class CriticConfig:
    """The value model of adv_estimator=gae (PPO): on the learner ranks, or on ranks of its own."""

    # colocated: sharded on the learner's ranks (no transfer; the step runs values, policy, critic in turn);
    # separate: `ranks` processes of its own (FSDP2 over their own group): its update runs while the policy
    # syncs weights and waits for the next batch
    placement: Literal["colocated", "separate"] = "colocated"
    ranks: int = 1  # placement=separate: the critic's ranks
    path: Optional[str] = None  # a causal-LM checkpoint whose trunk starts the critic (null: the policy's model)
    lr: float = 1e-5
    cliprange_value: float = 0.5  # clipped value loss: new values kept within this of the step's old values
    warmup_steps: int = 0  # steps that train only the critic (the policy is not updated, its version kept)
    gamma: float = 1.0  # GAE discount over generated tokens
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # GAE advantages whitened over the batch's generated tokens

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
    # how rewards become advantages: grpo | drgrpo | rloo | reinforce_pp, or a registered "advantage" plugin;
    # gae: PPO with a critic (algorithm.critic), per-token GAE over the generated tokens
    adv_estimator: str = "grpo"
    critic: CriticConfig = field(default_factory=CriticConfig)
    # per-turn credit: turn and tool rewards join the final reward where they arose, and each token's
    # advantage counts only the rewards from its turn on (asyncrl/learner/advantages.py); built-in estimators
    turn_credit: bool = False
    # the policy loss: ppo | gspo | cispo | sapo | reinforce, or a registered "loss" plugin (asyncrl/learner/losses.py)
    loss: str = "ppo"
    norm_adv_by_std: bool = True
    n_samples: int = 4  # samples per prompt (group size)
    max_staleness: int = 2  # eta: versions a trained token may lag the newest
    decoupled: bool = True  # proximal forward: ratio against the learner's pre-step weights
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_level: Literal["token", "sequence"] = "token"
    is_threshold: Optional[float] = 2.0  # truncation of the behavior importance weight (null: none, e.g. IcePop)
    is_reject_low: Optional[float] = None  # reject (mask) tokens/sequences whose weight is below
    is_reject_high: Optional[float] = None  # ... or above
    is_seq_mode: Literal["sum", "mean"] = "sum"  # sequence-level log weight: sum of token log ratios, or their mean
    sapo_tau_pos: float = 1.0  # loss=sapo: gate temperature for tokens with a positive advantage
    sapo_tau_neg: float = 1.05  # ... and for the others (higher: negative updates are damped faster off-policy)
    # max_staleness > 0 with nothing correcting staleness (decoupled=false and a loss that ignores the ratio)
    # is refused unless this is set
    allow_uncorrected_off_policy: bool = False
    kl_coef: float = 0.0  # weight of the KL to the frozen initial policy (0: no reference model)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    kl_in_reward: bool = False  # the KL as a per-token reward penalty before GAE (adv_estimator=gae), not a loss term
    entropy_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"] = "token_mean"
    lr: float = 1e-6  # AdamW learning rate of the policy
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    epochs: int = 1  # passes over each batch
    minibatches: int = 1  # optimizer steps per pass
    micro_batch_tokens: int = 4096  # token budget of one forward/backward
    packing: bool = True
    # packed micro-batches score the samples of one prompt as a tree: the prompt once, each response after
    # it (asyncrl/learner/packing.py); needs sdpa or eager attention, else each sample pays its prompt
    share_prompts: bool = True
    # an optimizer step whose loss or grad norm is not finite is skipped (grads dropped, counted in
    # learner/skipped_steps_nonfinite); this many in a row stop the run
    max_nonfinite_steps: int = 3

    def __post_init__(self) -> None:
        _check(self.max_nonfinite_steps >= 1, "algorithm.max_nonfinite_steps",
               f"must be >= 1, got {self.max_nonfinite_steps}")
        _check(self.n_samples >= 1, "algorithm.n_samples", f"must be >= 1, got {self.n_samples}")
        _check(not self.turn_credit or self.adv_estimator in ("grpo", "drgrpo", "rloo", "reinforce_pp"),
               "algorithm.turn_credit", "works with the built-in estimators grpo, drgrpo, rloo, reinforce_pp "
               "(their per-token form is documented; gae always places turn and tool rewards), not "
               f"adv_estimator={self.adv_estimator!r}")
        _check(self.n_samples >= 2 or self.adv_estimator not in GROUP_ESTIMATORS, "algorithm.n_samples",
               f"must be >= 2 with adv_estimator={self.adv_estimator} (its baseline is the group of samples "
               f"of one prompt; a group of 1 has advantage 0 and learns nothing), got {self.n_samples}")
        _check(self.max_staleness >= 0, "algorithm.max_staleness", f"must be >= 0, got {self.max_staleness}")
        _check(self.clip_low >= 0 and self.clip_high >= 0, "algorithm.clip_low/clip_high", "must be >= 0")
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
        _at_least(self, "algorithm", 0, "warmup_steps")
        _positive(self, "algorithm", "grad_clip")
        _check(0 <= self.min_lr_ratio <= 1, "algorithm.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.kl_coef >= 0 and self.weight_decay >= 0, "algorithm.kl_coef/weight_decay", "must be >= 0")
        _check(not self.kl_in_reward or (self.adv_estimator == "gae" and self.kl_coef > 0), "algorithm.kl_in_reward",
               "needs adv_estimator=gae (per-token rewards) and kl_coef > 0 (the penalty's weight), got "
               f"adv_estimator={self.adv_estimator!r}, kl_coef={self.kl_coef}")


@dataclass
class WeightSyncConfig:
    transport: Literal["auto", "gloo", "nccl", "tensor", "disk"] = "auto"
    bucket_mb: int = 256
    timeout_s: float = 120.0
    mode: Literal["in_place", "abort"] = "in_place"
    disk_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _at_least(self, "trainer.weight_sync", 1, "bucket_mb")
        _positive(self, "trainer.weight_sync", "timeout_s")


@dataclass
class TrainerConfig:
    mode: Literal["async", "sync"] = "async"  # sync: rollout waits for each weight sync (max_staleness 0)
    total_steps: int = 20  # training steps (policy versions) of the run
    # a wall-clock budget: no step starts once the run (warm start included) is this many minutes old; the run
    # then ends as at total_steps (checkpoint, final/) and its summary says so. 0: no budget
    max_minutes: float = 0.0
    batch_groups: int = 4  # prompts (groups) per training step
    rollout_workers: int = 1  # Ray actors running agent loops
    episodes_per_worker: int = 16  # concurrent agent loops per rollout worker
    max_inflight_generations: int = 16  # engine slots across the rollout side
    learner_ranks: int = 1  # FSDP2 ranks of the learner
    # asyncrl/run_dir.py owns the rule for the run's directory, the lock and what a start finds there
    run_name: Optional[str] = None  # the run's dir is outputs/<run_name> (None: the start time)
    output_dir: Optional[str] = None  # the run's dir, whatever run_name says
    checkpoint_every: int = 0  # steps; 0: only at the end
    keep_checkpoints: int = 2
    resume: Literal["off", "auto"] = "off"  # auto: the newest checkpoint of the run dir, or a fresh start saying so
    eval_every: int = 0  # steps; 0: no evaluation
    eval_pass_k: int = 1
    eval_samples: int = 32
    wandb: Literal["off", "offline", "online"] = "offline"  # offline: logged under the run dir, `wandb sync` later
    wandb_project: str = "asyncrl"
    dump_trajectories: float = 1.0  # fraction of trajectories written to trajectories.jsonl
    progress: bool = True
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    max_prompt_retries: int = 2  # re-issues of a prompt whose group the buffer dropped unserved; then skipped
    stall_timeout_s: float = 1800.0  # watchdog: stop (exit 4) when no step was trained for this long; 0: off
    max_failed_episode_fraction: float = 0.9  # watchdog: stop (exit 4) when more of the recent episodes failed
    failed_episode_window: int = 64  # ... the last episodes each rollout worker keeps; judged once this many exist
    # a learner rank blocked this long in a collective (a peer died or hangs) fails, and the run stops
    learner_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        _check(self.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {self.total_steps}")
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
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    wal_dir: Optional[str] = None  # None: <output_dir>/buffer
    fsync: Literal["each", "batched", "off"] = "batched"
    capacity_trajectories: int = 100_000
    capacity_bytes: int = 4 << 30
    order: Literal["oldest", "newest"] = "oldest"
    max_frame_bytes: int = 256 << 20
    # CURVE + a ZAP allow-list of the run's producer and consumer keys (asyncrl/buffer/keys.py);
    # auto: on for a non-loopback bind (which is refused without it)
    curve: Literal["off", "on", "auto"] = "auto"
    keys_dir: Optional[str] = None  # 0700 dir of z85 key files (created when absent); None: in-memory keys
    # online WAL compaction when the log exceeds max(compact_min_bytes, compact_ratio x the live state)
    # (asyncrl.buffer.wal.should_compact)
    compact_min_bytes: int = 64 << 20
    compact_ratio: float = 4.0
    # disk full: this much is preallocated beside the log and released when a write finds the disk full,
    # so serving and committing still log while PUTs are refused; acking resumes when space returns
    disk_reserve_bytes: int = 64 << 20
    disk_probe_s: float = 1.0  # while the disk is full: how often to check whether space returned
    # dedupe of uids that are not training uids (<run_id>-g<pos>[r<k>]-<i>): remembered exactly, at most this many
    dedupe_other_max: int = 1_000_000

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

    kind: Literal["none", "discriminative", "generative"] = "none"
    # discriminative: a sequence-classification checkpoint (one label: its logit is the score), on its own worker
    path: Optional[str] = None
    batch_size: int = 8  # discriminative: texts per forward (requests of all rollout workers are batched)
    max_wait_ms: float = 20.0  # ... how long a partial batch waits for more requests
    max_length: int = 2048  # ... tokens per text (longer texts keep their end)
    # generative: a prompt sent to the run's engine; {prompt}, {response} and {ground_truth} are filled in
    template: str = ("Rate the response to the request from 0 (wrong) to 9 (right).\nRequest: {prompt}\n"
                     "Response: {response}\nReply with one digit.")
    pattern: str = r"(\d+(?:\.\d+)?)"  # the first match's group 1 is the verdict
    scale: float = 9.0  # verdict / scale is the score
    max_new_tokens: int = 16
    weight: float = 1.0
    rule_weight: float = 1.0
    on_failure: Literal["zero", "fail_episode"] = "zero"  # a verdict that cannot be had or parsed
    timeout_s: float = 60.0

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
            import re

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

    # off: RL starts from the model as configured; on: always (the preflight refuses an env or agent that cannot
    # demonstrate); auto: when they can and model.path is unset (a preset's base model), else off (said once)
    mode: Literal["off", "auto", "on"] = "off"
    demos: int = 384  # demonstrations (of the first this many training rows)
    epochs: int = 1
    batch: int = 8  # demonstrations per SFT optimizer step
    lr: float = 1.0e-5  # SFT's learning rate (RL's is algorithm.lr)

    def __post_init__(self) -> None:
        _at_least(self, "warm_start", 1, "demos", "epochs", "batch")
        _check(math.isfinite(self.lr) and self.lr > 0, "warm_start.lr", f"must be a positive number, got {self.lr}")


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local instance; "auto": join a cluster
    num_cpus: Optional[int] = None

    def __post_init__(self) -> None:
        _check(self.num_cpus is None or self.num_cpus >= 1, "ray.num_cpus", f"must be >= 1, got {self.num_cpus}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    plugins: list[str] = field(default_factory=list)  # module paths or .py files to import
    seed: int = 0

    def __post_init__(self) -> None:
        if self.trainer.mode == "sync" and self.algorithm.max_staleness != 0:  # the one place sync means eta 0
            self.algorithm = dataclasses.replace(self.algorithm, max_staleness=0)
        longest = self.agent.max_prompt_tokens + self.agent.max_response_tokens
        _check(self.engine.type != "embedded" or longest <= self.engine.max_running_tokens, "engine.max_running_tokens",
               f"{self.engine.max_running_tokens} is less than agent.max_prompt_tokens + agent.max_response_tokens = "
               f"{longest}: the embedded engine could not hold the longest episode allowed")
        # SGLang reports the logprob after its min_new_tokens ban on stop tokens (renormalized), the
        # learner before it (asyncrl/engine/sampling.py): the importance ratios would be wrong
        min_new = self.agent.sampling.min_new_tokens
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
    return from_dict(Config, compose(overrides))
