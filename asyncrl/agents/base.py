"""The agent-loop interface, the per-episode machinery the built-in loops share, and `run_episode`.

An agent loop is a class registered with `@register("agent", name)` whose `run(sample, ctx)`
returns a finished `Trajectory` (or, to split an episode, a list of them: `run_episode_chains`). The
rollout worker calls only `run_episode_chains(sample, ctx, default)`.

Budgets (AgentConfig): each generation asks for max_new_tokens = min(max_turn_tokens, remaining)
where remaining = max_response_tokens - len(response_ids) (inserted tokens count too); a block of
inserted tokens that would leave no room for another generated token is not inserted and the
episode ends with finish_reason "length". Turn limits: max_assistant_turns counts generations,
max_user_turns counts interaction (simulated user) turns; tool results are not user turns.

finish_reason: "stop" (the model ended, the interaction said done), "length" (token budget),
"max_turns", "invalid_calls" (max_consecutive_invalid_calls in a row), "abort" (engine aborted).
Trajectory.reward is the env reward function's score; interaction scores go to turn_rewards. A
reward that is not finite fails the episode (`NonFiniteRewardError`, naming the function and the uid;
the rollout worker counts it and reports the episode failed, never retries it).
metrics: tool counters (see tool_runner), assistant_turns, user_turns, response_tokens,
generated_tokens, plus the reward function's extra numeric outputs under "reward/<key>".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl import registry
from asyncrl.config import AgentConfig, RewardConfig, ToolSpec
from asyncrl.data.schema import Trajectory
from asyncrl.engine.base import GenerateResult, Generator, SamplingParams
from asyncrl.envs.base import Deferred, Sample, checked_reward, resolve_reward_fn, score
from asyncrl.tools.loader import load_tool_specs, make_tools

from .chat import ChatFormat
from .trajectory_builder import TrajectoryBuilder


class PromptTooLongError(ValueError):
    """The rendered prompt exceeds AgentConfig.max_prompt_tokens (a data problem, not the model's)."""


@dataclass
class AgentContext:
    engine: Generator  # asyncrl.engine.base.Generator (an EngineClient, or a scripted double in tests)
    tokenizer: Any  # HF tokenizer
    cfg: AgentConfig
    tool_specs: list[ToolSpec]  # from tools.loader.load_tool_specs
    reward_fn: Callable  # sync or async; see asyncrl.envs.base.score
    env_name: str = ""
    tool_overrides: dict = field(default_factory=dict)  # {tool_name: {config_key: value}}
    interactions: list = field(default_factory=list)  # InteractionSpec (or dicts) configuring interactions by name
    reward_max_abs: float = RewardConfig().max_abs  # env.reward.max_abs: the bound an episode's reward must keep
    _tools: Optional[dict[str, Any]] = field(default=None, init=False, repr=False)

    @classmethod
    def for_config(cls, cfg: Any, engine: Generator, tokenizer: Any, tool_overrides: dict | None = None
                   ) -> AgentContext:
        """The context a run's config (asyncrl.config.Config) describes: its agent settings, the env's tools
        (with `tool_overrides` from the env's services, e.g. the retrieval server's url) and reward."""
        return cls(engine=engine, tokenizer=tokenizer, cfg=cfg.agent,
                   tool_specs=load_tool_specs(cfg.env.tools, cfg.env.tools_config),
                   reward_fn=resolve_reward_fn(cfg.env), env_name=cfg.env.name,
                   tool_overrides=dict(tool_overrides or {}), interactions=list(cfg.env.interactions),
                   reward_max_abs=cfg.env.reward.max_abs)

    def tools(self) -> dict[str, Any]:
        """The tool objects (built once per context, shared by its episodes; state is per instance_id)."""
        if self._tools is None:
            self._tools = make_tools(self.tool_specs, self.tool_overrides)
        return self._tools

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.tool_schema for t in self.tools().values()]

    def make_interaction(self, name: str) -> Any:
        """A fresh interaction object for one episode: configured by the matching spec, else registered."""
        cls, config = interaction_class(name, self.interactions)
        return cls(config)


def interaction_class(name: str, specs: list) -> tuple[Any, dict[str, Any]]:
    """The class of interaction `name` and its config: the spec of that name in `specs` (InteractionSpec
    or dict: class_name is registered or `module:Class`), else the interaction registered as `name`."""
    for spec in specs:
        s = spec if isinstance(spec, dict) else {"name": spec.name, "class_name": spec.class_name,
                                                  "config": spec.config}
        if s.get("name") == name:
            cls_name = s.get("class_name") or name
            cls = (registry.resolve_object(cls_name) if ("." in cls_name or ":" in cls_name)
                   else registry.get("interaction", cls_name))
            return cls, dict(s.get("config") or {})
    return registry.get("interaction", name), {}


class AgentLoop:
    """Base class of agent loops: `run(sample, ctx) -> Trajectory`."""

    name: str = ""

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        raise NotImplementedError

    def chat_format(self, tokenizer: Any, cfg: AgentConfig, tool_schemas: list[dict[str, Any]]) -> ChatFormat:
        """How this loop renders its prompt (the default: no tools); preflight measures rows with it."""
        return ChatFormat(tokenizer, system_prompt=cfg.system_prompt)


def sampling_params(ctx: AgentContext, max_new_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
    s = ctx.cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=max_new_tokens,
                          min_new_tokens=min(s.min_new_tokens, max_new_tokens), stop_token_ids=list(stop_token_ids))


class Episode:
    """One episode's state: the token arrays, readable messages, counters, turns and rewards."""

    def __init__(self, sample: Sample, ctx: AgentContext, agent: str, chat: ChatFormat,
                 messages: list[dict[str, Any]]):
        self.sample, self.ctx, self.agent, self.chat = sample, ctx, agent, chat
        self.cfg = ctx.cfg
        self.messages = [dict(m) for m in messages]
        prompt = chat.prompt_ids(self.messages)
        if len(prompt) > self.cfg.max_prompt_tokens:
            raise PromptTooLongError(f"sample {sample.uid} (data_index {sample.data_index}): prompt has {len(prompt)} "
                                     f"tokens, over agent.max_prompt_tokens={self.cfg.max_prompt_tokens}")
        self.builder = TrajectoryBuilder(prompt, self.cfg.max_response_tokens)
        self.metrics: Counter = Counter()
        self.turn_rewards: list[float] = []
        self.tool_rewards: list[float] = []
        self.turn_reward_positions: list[int] = []  # the last generated token before each reward arose
        self.tool_reward_positions: list[int] = []
        self.assistant_turns = 0
        self.user_turns = 0
        self.finish_reason = "stop"
        self.stop_ids = chat.stop_token_ids()

    async def generate(self) -> Optional[GenerateResult]:
        """One assistant generation appended to the trajectory; None (finish "length") when no budget is left."""
        max_new = min(self.cfg.max_turn_tokens, self.builder.remaining)
        if max_new <= 0:
            self.finish_reason = "length"
            return None
        sp = sampling_params(self.ctx, max_new, self.stop_ids)
        if self.sample.sampling_seed is not None:
            sp.sampling_seed = self.sample.sampling_seed + self.assistant_turns
        out = await self.ctx.engine.generate(self.builder.context(), sp, rid=f"{self.sample.uid}-t{self.assistant_turns}",
                                             session_id=self.sample.uid)
        self.builder.add_generated(out.output_ids, out.logprobs, out.versions)
        self.assistant_turns += 1
        self.metrics["generated_tokens"] += len(out.output_ids)
        return out

    def add_turn_reward(self, score: float) -> None:
        """An interaction's score for the turn just generated (placed at its last generated token)."""
        self.turn_rewards.append(float(score))
        self.turn_reward_positions.append(self.builder.last_generated_index())

    def set_tool_rewards(self, rewards: list[float]) -> None:
        """The episode's tool rewards so far (the runner's running list): the new ones are placed at the
        last generated token, the end of the turn whose calls earned them."""
        new = [float(x) for x in rewards[len(self.tool_rewards):]]
        self.tool_rewards += new
        self.tool_reward_positions += [self.builder.last_generated_index()] * len(new)

    def decode(self, ids: list[int]) -> str:
        return self.ctx.tokenizer.decode(ids, skip_special_tokens=True)

    def insert_ids(self, ids: list[int]) -> bool:
        """Append inserted (masked) ids if at least one generated token still fits after them."""
        if len(ids) >= self.builder.remaining:
            self.finish_reason = "length"
            return False
        self.builder.add_inserted(ids)
        self.metrics["inserted_tokens"] += len(ids)
        return True

    def insert_messages(self, new: list[dict[str, Any]], generated_ids: list[int]) -> bool:
        """Render `new` as a template delta after the last generation, tokenize once, append masked."""
        if not self.insert_ids(self.chat.delta_ids(new, generated_ids)):
            return False
        self.messages.extend(new)
        return True

    async def finish(self, final_text: str) -> Trajectory:
        s, ctx = self.sample, self.ctx
        response = list(self.builder.response_ids)
        reward, extra = await score(ctx.reward_fn, final_text=final_text, ground_truth=s.ground_truth,
                                    extra_info=s.extra_info, tool_rewards=list(self.tool_rewards),
                                    turn_rewards=list(self.turn_rewards), data_source=s.data_source,
                                    solution_str=Deferred(lambda: ctx.tokenizer.decode(response, skip_special_tokens=True)))
        name = getattr(ctx.reward_fn, "__qualname__", None) or type(ctx.reward_fn).__qualname__
        reward = checked_reward(reward, ctx.reward_max_abs, f"reward function {name} (for {s.uid})")
        metrics = {k: float(v) for k, v in self.metrics.items()}
        metrics.update({f"reward/{k}": v for k, v in extra.items()})
        metrics.update(assistant_turns=float(self.assistant_turns), user_turns=float(self.user_turns),
                       response_tokens=float(len(self.builder.response_ids)))
        return self.builder.build(
            uid=s.uid, group_id=s.group_id, group_size=s.group_size, env=ctx.env_name, agent=self.agent,
            reward=reward, turn_rewards=[float(r) for r in self.turn_rewards],
            turn_reward_positions=list(self.turn_reward_positions), tool_rewards=list(self.tool_rewards),
            tool_reward_positions=list(self.tool_reward_positions),
            num_turns=self.assistant_turns + self.user_turns, finish_reason=self.finish_reason, metrics=metrics,
            messages=self.messages, data_index=s.data_index, sample_index=s.sample_index)


class InteractionSession:
    """The row's interaction (extra_info.interaction_kwargs.name) for one episode, or none."""

    def __init__(self, sample: Sample, ctx: AgentContext):
        kw = sample.interaction_kwargs
        self.kwargs = dict(kw or {})
        self.obj = ctx.make_interaction(str(self.kwargs["name"])) if kw and kw.get("name") else None
        self.instance_id = sample.uid
        self._started = False
        if self.obj is not None:
            self.kwargs.setdefault("ground_truth", sample.ground_truth)

    def __bool__(self) -> bool:
        return self.obj is not None

    async def respond(self, messages: list[dict[str, Any]]) -> tuple[bool, str, float, dict[str, Any]]:
        if not self._started:
            got = await self.obj.start(self.instance_id, **self.kwargs)
            self.instance_id = got if isinstance(got, str) and got else self.instance_id
            self._started = True
        done, text, sc, extra = await self.obj.respond(self.instance_id, messages)
        return bool(done), str(text), float(sc), dict(extra or {})

    async def close(self) -> None:
        if self.obj is not None and self._started:
            await self.obj.finish(self.instance_id)


def resolve_agent(name: str) -> AgentLoop:
    obj = registry.get("agent", name)
    return obj() if isinstance(obj, type) else obj


async def run_episode_chains(sample: Sample, ctx: AgentContext, default_agent: str) -> list[Trajectory]:
    """Run the row's agent loop (sample.agent_name, else `default_agent`): its trajectories, the episode's
    main one first. A loop returns one Trajectory, or a list when it splits the episode (openai_agent when
    the agent rewrote its history): then each carries `episode_chains` = the list's length and the
    sample's group and sample_index, so the buffer's group waits for all of them. Model and tool
    misbehaviour ends up in the trajectory; anything else (engine down, a bug) propagates."""
    name = sample.agent_name or default_agent
    got = await resolve_agent(name).run(sample, ctx)
    chains = got if isinstance(got, list) else [got]
    if not chains or not all(isinstance(t, Trajectory) for t in chains):
        kinds = ", ".join(type(t).__name__ for t in chains) if isinstance(got, list) else type(got).__name__
        raise TypeError(f"agent {name!r} returned {kinds or 'an empty list'}, expected a Trajectory or a "
                        "non-empty list of them")
    for t in chains:
        t.validate()
        if (t.episode_chains, t.group_id, t.sample_index) != (len(chains), sample.group_id, sample.sample_index):
            raise ValueError(f"agent {name!r}: trajectory {t.uid} of a {len(chains)}-trajectory episode has "
                             f"episode_chains={t.episode_chains}, group {t.group_id!r}, sample_index "
                             f"{t.sample_index}; expected {len(chains)}, {sample.group_id!r}, {sample.sample_index}")
    if len({t.uid for t in chains}) != len(chains):
        raise ValueError(f"agent {name!r}: the trajectories of one episode share a uid")
    return chains


async def run_episode(sample: Sample, ctx: AgentContext, default_agent: str) -> Trajectory:
    """The episode's main trajectory (`run_episode_chains`' first): what evaluation scores."""
    return (await run_episode_chains(sample, ctx, default_agent))[0]
