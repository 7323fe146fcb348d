"""Reward models on the rollout side: finished episodes are scored before they enter the buffer, so the
learner never waits for a reward model.

Two kinds (`reward_model.kind`, RewardModelConfig):
- discriminative: a sequence-classification checkpoint (one label; its logit is the score) served by
  `SequenceScorer` on its own worker (`RewardModelActor`, a Ray actor). Requests from every rollout
  worker queue there and are batched: a batch is cut at `batch_size` texts, or after `max_wait_ms`
  when fewer are waiting. A text longer than `max_length` tokens keeps its end (the response).
- generative: a judge prompt (`template`, with {prompt}, {response}, {ground_truth} substituted
  literally: no format-string evaluation of model text) sent as a user turn through the model's chat
  template to the run's own engine, greedy; the first match of `pattern` in the reply, divided by
  `scale`, is the score.

Combination: reward = rule_weight * rule + weight * model, where rule is the env's reward function's
score. Each trajectory's metrics gain reward/rule, reward/model and reward_model/seconds; a verdict that
cannot be had (timeout, error, unparsable reply, non-finite score) is reward_model/failed = 1 and scores 0
(`on_failure: zero`) or fails the episode (`fail_episode`: RewardModelError).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from asyncrl.config import RewardModelConfig
from asyncrl.data.schema import Trajectory
from asyncrl.engine.base import SamplingParams


class RewardModelError(RuntimeError):
    """No verdict for an episode with reward_model.on_failure=fail_episode."""


def conversation_text(messages: list[dict[str, Any]], tokenizer: Any = None) -> str:
    """An episode's conversation as the reward model reads it: its chat template where it has one, else
    'role: content' lines."""
    msgs = [{"role": str(m.get("role", "")), "content": str(m.get("content") or "")} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs)


# ----------------------------------------------------------------------------- discriminative


class SequenceScorer:
    """A sequence-classification model behind a batching queue (one per process; asyncio)."""

    def __init__(self, cfg: RewardModelConfig, device: str = "cpu"):
        # lazy: imports torch, transformers, which this module does not load otherwise
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.tokenizer.truncation_side = "left"  # keep the end: the response being judged
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=torch.float32).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_model.path={cfg.path}: a reward model has one label (its logit is the score), "
                             f"this one has {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.queue: asyncio.Queue[tuple[str, asyncio.Future]] = asyncio.Queue()
        self.batches: list[int] = []  # the size of each batch run (for tests and metrics)
        self._loop_task: Optional[asyncio.Task] = None

    def score_now(self, texts: list[str]) -> list[float]:
        """One forward over `texts` (no queue)."""
        # lazy: imports torch, which this module does not load otherwise
        import torch

        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.cfg.max_length)
        with torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return [float(x) for x in logits[:, 0].float().cpu()]

    async def score(self, texts: list[str]) -> list[float]:
        """Scores of `texts`, batched with whatever else is waiting."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._serve())
        loop = asyncio.get_running_loop()
        futures = []
        for t in texts:
            f = loop.create_future()
            self.queue.put_nowait((t, f))
            futures.append(f)
        return list(await asyncio.gather(*futures))

    async def score_conversations(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        """Scores of conversations, each rendered with this model's chat template (conversation_text)."""
        return await self.score([conversation_text(c, self.tokenizer) for c in conversations])

    async def _serve(self) -> None:
        while True:
            batch = [await self.queue.get()]
            deadline = asyncio.get_running_loop().time() + self.cfg.max_wait_ms / 1000
            while len(batch) < self.cfg.batch_size:
                left = deadline - asyncio.get_running_loop().time()
                try:
                    batch.append(self.queue.get_nowait() if left <= 0 and not self.queue.empty()
                                 else await asyncio.wait_for(self.queue.get(), timeout=max(left, 0)))
                except (asyncio.TimeoutError, asyncio.QueueEmpty):
                    break
            self.batches.append(len(batch))
            try:
                scores = await asyncio.to_thread(self.score_now, [t for t, _ in batch])
            except Exception as e:  # each waiting request gets the error
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            for (_, f), s in zip(batch, scores):
                if not f.done():
                    f.set_result(s)


def reward_model_actor():
    """The Ray actor class serving a SequenceScorer on its own worker (built lazily: ray is imported here)."""
    # lazy: imports ray, which this module does not load otherwise
    import ray

    @ray.remote(num_cpus=0)  # scheduled beside the run's other actors; it holds no CPU reservation
    class RewardModelActor:
        def __init__(self, cfg: RewardModelConfig):
            self.scorer = SequenceScorer(cfg)

        async def score_conversations(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
            return await self.scorer.score_conversations(conversations)

        def ready(self) -> bool:
            return True

    return RewardModelActor


class ActorScorer:
    """A rollout worker's client of the RewardModelActor."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def score_conversations(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        return await self.handle.score_conversations.remote(conversations)


# ----------------------------------------------------------------------------- generative


def fill_template(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """The judge prompt: each placeholder replaced literally (model text is never a format string)."""
    values = {"ground_truth": "" if ground_truth is None else str(ground_truth), "prompt": prompt,
              "response": response}
    # one pass over the template: text put in is never scanned again (a prompt holding "{response}" stays so)
    return re.sub(r"\{(ground_truth|prompt|response)\}", lambda m: values[m.group(1)], template)


def parse_verdict(text: str, pattern: str, scale: float) -> Optional[float]:
    """The first match of `pattern` (its group 1) divided by `scale`; None when there is none or it is not
    a finite number."""
    m = re.search(pattern, text)
    if m is None:
        return None
    try:
        v = float(m.group(1)) / scale
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


class GenerativeJudge:
    def __init__(self, cfg: RewardModelConfig, engine: Any, tokenizer: Any):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer

    async def verdict(self, prompt: str, response: str, ground_truth: Any, rid: str) -> tuple[Optional[float], str]:
        """(score or None, the judge's reply)."""
        text = fill_template(self.cfg.template, prompt, response, ground_truth)
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                 add_generation_prompt=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        stop = [i for i in (self.tokenizer.eos_token_id,) if i is not None]
        sp = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.max_new_tokens, stop_token_ids=stop)
        out = await self.engine.generate(ids, sp, rid=rid)
        reply = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return parse_verdict(reply, self.cfg.pattern, self.cfg.scale), reply


# ----------------------------------------------------------------------------- combination


@dataclass
class Verdict:
    score: Optional[float]
    seconds: float
    error: str = ""


class RewardModel:
    """What a rollout worker calls: `apply(sample_prompt, ground_truth, trajectories)`."""

    def __init__(self, cfg: RewardModelConfig, *, scorer: Any = None, judge: Optional[GenerativeJudge] = None):
        self.cfg, self.scorer, self.judge = cfg, scorer, judge
        self.failures = 0

    async def _verdict(self, traj: Trajectory, prompt: str, ground_truth: Any) -> Verdict:
        t0 = time.perf_counter()
        try:
            if self.judge is not None:
                response = next((str(m.get("content") or "") for m in reversed(traj.messages)
                                 if m.get("role") == "assistant"), "")
                score, reply = await asyncio.wait_for(
                    self.judge.verdict(prompt, response, ground_truth, rid=f"{traj.uid}-judge"), self.cfg.timeout_s)
                err = "" if score is not None else f"unparsable verdict {reply[:80]!r}"
            else:
                [score] = await asyncio.wait_for(self.scorer.score_conversations([traj.messages]), self.cfg.timeout_s)
                score = float(score) if math.isfinite(score) else None
                err = "" if score is not None else "non-finite score"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # timeout, a dead reward-model worker, an engine error
            score, err = None, f"{type(e).__name__}: {e}"
        return Verdict(score, time.perf_counter() - t0, err)

    async def apply(self, prompt: str, ground_truth: Any, trajs: list[Trajectory]) -> list[Trajectory]:
        verdicts = await asyncio.gather(*(self._verdict(t, prompt, ground_truth) for t in trajs))
        out = []
        for t, v in zip(trajs, verdicts):
            failed = v.score is None
            if failed:
                self.failures += 1
                if self.cfg.on_failure == "fail_episode":
                    raise RewardModelError(f"reward model gave no verdict for {t.uid}: {v.error}")
            model = 0.0 if failed else v.score
            reward = self.cfg.rule_weight * t.reward + self.cfg.weight * model
            metrics = {**t.metrics, "reward/rule": t.reward, "reward/model": model,
                       "reward_model/seconds": v.seconds, "reward_model/failed": float(failed)}
            out.append(msgspec.structs.replace(t, reward=reward, metrics=metrics))
        return out
