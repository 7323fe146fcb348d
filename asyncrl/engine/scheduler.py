"""EngineCore: owns the model, the request queue and the continuous-batching decode loop.

One asyncio task runs the loop. Each iteration, under `self.lock`:
  1. admit one-token requests (liveness probes: they end at their prefill and take no running
     slot) first, then waiting requests (FIFO) while running < max_running_seqs and the running
     tokens (prompt + generated) stay <= max_running_tokens, at most `prefill_tokens_per_step`
     prompt tokens per iteration (the first admission is always allowed); with CUDA graphs on
     (engine/graphs.py), only once `admit_rows` rows are free or all that wait fit;
  2-3. one forward (`_step`, engine/fused.py) for the running rows' next tokens and the admitted
     prompts together: requests admitted together with the same input_ids (a GRPO group's samples)
     share one prompt in it, each draws its own token with its own generator, and each admitted
     request that goes on takes a free row of the KV slots (its K/V written there by the forward).
     A step where no prompt joins replays a captured CUDA graph when graphs are on (GPU).
     For a model whose attention cannot run that way (`supports_fused`), the same in two parts: a
     forward per distinct prompt (`_prefill`, logits of the last position only, K/V copied into a row
     by `KVSlots.add`), then one decode forward for all running rows (right-aligned rows in fixed
     slots, 2-D mask, per-row positions);
  4. finished rows (stop token, max_new_tokens, context limit, abort) leave the batch (the last row
     moves into the freed one: `KVSlots.remove`) and their replies are sent; the others continue.
     Nobody waits for the longest sequence.
Forwards run in a worker thread (`asyncio.to_thread`) so the HTTP server stays responsive.
`apply_weights` takes the same lock, so it never overlaps a forward.
A forward that raises answers the requests it held with an error (HTTP 500) and the loop goes on: a
failed step fails the running batch and the requests it admitted (in the two-part layout a failed
prefill fails only its own requests); no request is left unanswered. (Sampling values are validated at parse time, so a well-formed request never does this.)

Versions: every drawn token records `weight_version` at the step that produced it; the reply
reports them as SGLang's `weight_versions` spans (protocol.build_reply).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from asyncrl.config import EngineConfig
from asyncrl.engine.fused import Segment, StepPlan, prompt_writes, supports_fused, use_slot_attention
from asyncrl.engine.graphs import MIN_COLUMNS, DecodeGraphs, supports_graphs
from asyncrl.engine.kvbatch import KVSlots
from asyncrl.engine.protocol import BadRequest, GenRequest, build_reply
from asyncrl.engine.sampling import sample_tokens, token_logprobs

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")  # retract (SGLang) is treated as in_place


class EngineCore:
    """`settings`: the engine's settings (the run's `engine` config, EngineConfig, validated there; None:
    its defaults): the scheduler reads max_running_seqs and max_running_tokens from it."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        weight_version: int = 0,
        prefill_tokens_per_step: int = 2048,
        fused: bool | None = None,
        graphs: bool | None = None,
    ):
        self.settings = settings if settings is not None else EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.weight_version = int(weight_version)
        self.max_running_seqs = self.settings.max_running_seqs
        self.max_running_tokens = self.settings.max_running_tokens
        self.prefill_tokens_per_step = prefill_tokens_per_step
        cfg = model.config
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.device = next(model.parameters()).device
        self.lock = asyncio.Lock()
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.running: list[GenRequest] = []  # row i of self.kv is running[i]
        self.live: dict[str, GenRequest] = {}
        self.paused = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.tokens_out = 0
        self.steps = 0
        self.prefills = 0  # prompts prefilled (a shared prompt counts once)
        # one forward per step, admitted prompts riding with the decode rows (engine/fused.py), where the
        # model's attention allows it; else a forward per prompt, then the batched decode
        self.fused = supports_fused(model) if fused is None else bool(fused)
        if self.fused:
            use_slot_attention(model)
            self._n_layers = int(cfg.num_hidden_layers)
            heads = int(cfg.num_attention_heads)
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
            self._kv_like = torch.empty((1, int(getattr(cfg, "num_key_value_heads", None) or heads), 1, head_dim),
                                        dtype=next(model.parameters()).dtype, device=self.device)
        # pure decode steps replayed as CUDA graphs (engine/graphs.py); `graphs=True` on a CPU runs the same
        # static-buffer step without capturing (the tests' way to check it)
        on_gpu = self.device.type == "cuda"
        if graphs is None:
            graphs = self.settings.cuda_graphs and on_gpu
        graphs = bool(graphs and self.fused and supports_graphs(model))
        # with graphs the slab keeps its buffers (the captured kernels read their addresses)
        self.kv = (KVSlots(self.max_running_seqs, fixed_buffers=True, min_capacity=MIN_COLUMNS) if graphs
                   else KVSlots(self.max_running_seqs))
        self.graphs = DecodeGraphs(model, self.kv, self.max_running_seqs, capture=on_gpu) if graphs else None
        # while graphs are on, waiting requests join in batches of at least this many rows (or all that
        # wait): a step where prompts join runs eagerly, a pure decode step replays its graph
        self.admit_rows = max(1, self.max_running_seqs // 8) if self.graphs is not None else 1

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> dict:
        """Queue `req` and wait for its reply. A rid that is live already is refused (400), as SGLang
        refuses it: a client retrying after a timeout or a 5xx sends a fresh rid."""
        if req.rid in self.live:
            raise BadRequest(f"Duplicate request ID detected: {req.rid}")
        if len(req.input_ids) >= self.max_context:
            raise BadRequest(f"input_ids has {len(req.input_ids)} tokens; the model's context is {self.max_context}")
        if len(req.input_ids) + req.max_new_tokens > self.max_context:  # SGLang's rule and words (tokenizer_manager)
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.max_context} tokens. "
                f"You requested a total of {len(req.input_ids) + req.max_new_tokens} tokens: {len(req.input_ids)} "
                f"tokens from the input messages and {req.max_new_tokens} tokens for the completion."
            )
        if len(req.input_ids) > self.max_running_tokens:
            raise BadRequest(
                f"input_ids has {len(req.input_ids)} tokens, more than max_running_tokens={self.max_running_tokens}"
            )
        req.future = asyncio.get_running_loop().create_future()
        req.generator = torch.Generator(device="cpu")
        if req.sampling_seed is not None:
            req.generator.manual_seed(req.sampling_seed)
        else:
            req.generator.seed()
        self.live[req.rid] = req
        if req.max_new_tokens == 0:
            req.finish = {"type": "length", "length": 0}
            self._resolve(req)
        else:
            self.waiting.append(req)
            self._wake.set()
        return await asyncio.shield(req.future)

    async def abort(self, rid: str = "", abort_all: bool = False, *, exact: bool = False) -> int:
        """Finish every request whose rid STARTS WITH `rid` (SGLang's scheduler matches by prefix; with
        `exact`, only the request of that rid), or all, with finish_reason abort and its partial output;
        returns how many. An empty rid without abort_all aborts nothing (SGLang ignores it: it would
        prefix-match every request)."""
        if not abort_all and not rid:
            return 0

        def hit(r: GenRequest) -> bool:
            return abort_all or (r.rid == rid if exact else r.rid.startswith(rid))

        n = 0
        for r in list(self.waiting):
            if hit(r):
                self.waiting.remove(r)
                r.finish = {"type": "abort", "message": "aborted by request"}
                self._resolve(r)
                n += 1
        for r in list(self.live.values()):  # running, or admitted and about to be prefilled
            if hit(r) and not r.finished and not r.abort_requested:
                r.abort_requested = True
                n += 1
        if n and self.running:
            if self.paused:  # no step will run to reap them: do it now
                async with self.lock:
                    self._reap()
            self._wake.set()
        return n

    # ---- control (the weight-sync router drives these) ---------------------------------------
    async def pause(self, mode: str) -> None:
        """in_place: stop scheduling steps, keep KV caches and the queue. abort: finish every running
        and queued request now with finish_reason abort and its partial output. Returns once no
        forward is in progress."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused = True
        async with self.lock:
            if mode == "abort":
                for r in list(self.waiting) + self.running:
                    r.finish = {"type": "abort", "message": "engine paused with mode=abort"}
                    self._resolve(r)
                self.waiting.clear()
                self.running = []
                self.kv.clear()

    async def resume(self) -> None:
        self.paused = False
        self._wake.set()

    async def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Copy tensors into the live parameters in place (names of model.state_dict()), then set
        weight_version to `version` (or +1). Raises ValueError naming the tensor on an unknown name or
        a shape mismatch (tensors before it stay copied). Holds the decode loop's lock."""
        async with self.lock:
            await asyncio.to_thread(self._copy_weights, named_tensors)
            self.weight_version = int(version) if version is not None else self.weight_version + 1

    def _copy_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        targets = self.model.state_dict()
        n = 0
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in targets:
                    raise ValueError(f"weight {name!r} is not a parameter of the served model "
                                     f"(e.g. {list(targets)[:3]})")
                dst = targets[name]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, the model's is {tuple(dst.shape)}")
                dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
                n += 1
        return n

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "paused": self.paused,
                "weight_version": self.weight_version, "tokens_out": self.tokens_out, "steps": self.steps,
                "prefills": self.prefills, "kv_rebuilds": self.kv.rebuilds,
                "graph_captures": self.graphs.captures if self.graphs else 0,
                "graph_replays": self.graphs.replays if self.graphs else 0}

    # ---- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if self.paused or (not self.waiting and not self.running):
                self._wake.clear()
                await self._wake.wait()
                continue
            admitted: list[GenRequest] = []
            try:
                async with self.lock:
                    if self.paused:
                        continue
                    self._reap()
                    admitted = self._admit()
                    if self.fused:
                        await asyncio.to_thread(self._step, _same_prompts(admitted))
                        for r in admitted:  # one that ended at its first token and took no row
                            if r.finished and r not in self.running:
                                self._resolve(r)
                        self._reap()
                        continue
                    for same in _same_prompts(admitted):
                        try:
                            await asyncio.to_thread(self._prefill, same)
                        except Exception as e:  # this prompt's own forward failed: its requests alone fail
                            log.exception("prefill of request(s) %s failed", [r.rid for r in same])
                            self._fail([r for r in same if not r.finished and r not in self.running], e)
                        for r in same:
                            admitted.remove(r)
                            if r.finished:
                                self._resolve(r)
                    if self.running:
                        await asyncio.to_thread(self._decode)
                        self._reap()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a batch forward failed: answer every request it held, keep serving
                log.exception("engine step failed")
                self._fail(self.running + admitted, e)
                self.running = []
                self.kv.clear()
            await asyncio.sleep(0)

    def _fail(self, reqs: list[GenRequest], e: BaseException) -> None:
        """Answer `reqs` with an error (HTTP 500, which a client retries); never leave one unanswered."""
        for r in reqs:
            self.live.pop(r.rid, None)
            if r.future is not None and not r.future.done():
                r.future.set_exception(RuntimeError(f"engine step failed: {e!r}"))

    def _admit(self) -> list[GenRequest]:
        """Requests to prefill this step. A one-token request (a liveness probe) ends at its prefill and
        holds no running slot, so it goes first, whatever the running batch: a busy engine answers a
        probe at its next step boundary. The others: FIFO within the slot and token budgets."""
        out: list[GenRequest] = []
        budget = self.prefill_tokens_per_step
        for r in [r for r in self.waiting if r.max_new_tokens == 1]:
            if out and len(r.input_ids) > budget:
                break
            self.waiting.remove(r)
            out.append(r)
            budget -= len(r.input_ids)
        slots = 0
        free = self.max_running_seqs - len(self.running)
        if self.running and free < min(self.admit_rows, len(self.waiting)):
            return out  # graphs on: wait for a batch of free rows (the running ones decode meanwhile)
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in self.running)
        while self.waiting and len(self.running) + slots < self.max_running_seqs:
            need = len(self.waiting[0].input_ids)
            if (self.running or out) and (tokens + need > self.max_running_tokens or need > budget):
                break
            out.append(self.waiting.popleft())
            slots += 1
            tokens += need
            budget -= need
        return out

    def _reap(self) -> None:
        """Remove finished (or abort-requested) rows from the batch and send their replies."""
        for r in self.running:
            if r.abort_requested and not r.finished:
                r.finish = {"type": "abort", "message": "aborted by request"}
        for i in reversed(range(len(self.running))):  # from the end: a moved row is one already kept
            r = self.running[i]
            if r.finished:
                self._resolve(r)
                self.kv.remove(i)
                last = self.running.pop()
                if i < len(self.running):
                    self.running[i] = last

    def _resolve(self, r: GenRequest) -> None:
        self.live.pop(r.rid, None)
        if r.future is not None and not r.future.done():
            r.future.set_result(build_reply(r, self.weight_version, self._text(r.output_ids)))

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.inference_mode()
    def _step(self, groups: list[list[GenRequest]]) -> None:
        """The fused step (engine/fused.py): one forward for the running rows' next tokens and the
        prompts of `groups` (requests sharing a prompt); every request draws one token; admitted
        requests that can go on (max_new_tokens > 1) take rows after the running ones."""
        n = len(self.running)
        ids = [r.output_ids[-1] for r in self.running]
        if self.graphs is not None and n and not groups:  # a pure decode step: its graph replays
            col, _ = self.kv.begin_step([], self._kv_like, self._n_layers)
            logits = self.graphs.step(ids, col)
            self.kv.end_step(0)
            self.steps += 1
            self._emit(list(self.running), logits)
            return
        segments, new_lengths, takers = [], [], []
        for g in groups:
            p, start = len(g[0].input_ids), len(ids)  # the flat row so far: decode tokens, earlier prompts
            rows = []
            for r in g:
                if r.max_new_tokens > 1:
                    rows.append(n + len(takers))
                    new_lengths.append(p)
                    takers.append(r)
            segments.append(Segment(start, start + p, rows))
            ids.extend(g[0].input_ids)
        col, mask = self.kv.begin_step(new_lengths, self._kv_like, self._n_layers)
        pos = [self.kv.real[:n]] + [torch.arange(s.end - s.start, device=self.device) for s in segments]
        keep = list(range(n)) + [s.end - 1 for s in segments]
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                         position_ids=torch.cat(pos).unsqueeze(0).to(self.device), use_cache=False,
                         logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                         asyncrl_plan=StepPlan(self.kv, n, col, mask, segments,
                                               prompt_writes(segments, col + 1, self.device)))
        self.kv.end_step(len(takers))
        logits = out.logits[0]
        reqs, rows = list(self.running), [logits[:n]]
        for j, g in enumerate(groups):
            reqs.extend(g)
            rows.append(logits[n + j].expand(len(g), -1))
        self.steps += 1 if n else 0
        self.prefills += len(groups)
        self._emit(reqs, torch.cat(rows))
        self.running.extend(takers)

    @torch.inference_mode()
    def _prefill(self, reqs: list[GenRequest]) -> None:
        """One forward over the prompt `reqs` share; each draws its first token and, unless that
        finished it, takes a row of the running batch."""
        ids = torch.tensor([reqs[0].input_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        self.prefills += 1
        self._emit(reqs, out.logits[:, -1].expand(len(reqs), -1))
        for r in reqs:
            if not r.finished:
                self.kv.add(out.past_key_values)
                self.running.append(r)

    @torch.inference_mode()
    def _decode(self) -> None:
        last = torch.tensor([[r.output_ids[-1]] for r in self.running], dtype=torch.long, device=self.device)
        attn, pos, cache_pos = self.kv.step_inputs()
        out = self.model(input_ids=last, attention_mask=attn, position_ids=pos, cache_position=cache_pos,
                         past_key_values=self.kv.cache(), use_cache=True)
        self.kv.appended()
        self.steps += 1
        self._emit(self.running, out.logits[:, -1])

    def _emit(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        """Draw one token per row, record its logprob (sampling.token_logprobs), version and time,
        and set finish_reason where a stop condition holds."""
        logits = logits.float()  # on the model's device: the whole step is drawn there at once
        vocab = logits.shape[-1]
        banned = [tuple(t for t in (r.stop_token_ids | (frozenset() if r.ignore_eos else self.eos_ids)) if 0 <= t < vocab)
                  if len(r.output_ids) < r.min_new_tokens else () for r in reqs]
        tokens = sample_tokens(logits, [r.temperature for r in reqs], [r.top_k for r in reqs], [r.top_p for r in reqs],
                               banned, [r.generator for r in reqs])
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=logits.device)
        lps = token_logprobs(logits, torch.tensor(tokens, device=logits.device), temps).tolist()
        now = time.monotonic()
        for r, t, lp in zip(reqs, tokens, lps):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.weight_version)
            r.times.append(now)
            self.tokens_out += 1
            n = len(r.output_ids)
            if n >= r.min_new_tokens and (t in r.stop_token_ids or (not r.ignore_eos and t in self.eos_ids)):
                r.finish = {"type": "stop", "matched": t}
            elif n >= r.max_new_tokens or len(r.input_ids) + n >= self.max_context:
                r.finish = {"type": "length", "length": n}


def _same_prompts(reqs: list[GenRequest]) -> list[list[GenRequest]]:
    """`reqs` grouped by identical input_ids, in order of first appearance (one prefill per group)."""
    groups: dict[tuple[int, ...], list[GenRequest]] = {}
    for r in reqs:
        groups.setdefault(tuple(r.input_ids), []).append(r)
    return list(groups.values())
