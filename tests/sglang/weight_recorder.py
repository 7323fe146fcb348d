"""The weight-update side of the recorder backend (conftest.RecordingTokenizerManager): what SGLang
0.5.23's TokenizerManager + scheduler + model runner answer to the weight-update routes, read from
its source (paths under sglang/srt/). The route functions in entrypoints/http_server.py are SGLang's
own: they turn the (success, message) returned here into HTTP 200 / 400 {"success", "message"}.

    group      init_weights_update_group joins the update group for real with SGLang's own
               init_custom_process_group (utils/common.py:2859: tcp rendezvous, PrefixStore(group_name))
               at rank rank_offset + tp_rank (model_runner_components/weight_updater.py:100-144);
               destroy of an unknown group is refused (weight_updater.py:146-157)
    session    begin twice refused, end without begin refused, distributed and tensor updates outside
               a session refused (scheduler_components/weight_updater.py:187-198, 232-240, 309-335)
    receive    one broadcast per tensor into torch.empty(shape, dtype) (model runner weight_updater.py:
               260-298); an unknown group is "Failed to receive weights: ..." (scheduler weight_updater.py:210)
    load       model.load_weights in order, so a bad tensor leaves earlier ones applied: "Failed to
               update parameter online: ..." (model runner weight_updater.py:324-342); as Llama's
               loader does, a shape it cannot take fails, a name it does not hold is skipped with a
               warning (NOT refused), a dtype is converted (see _load)
    disk       no session; a failure rolls back: "Failed to update weights: ... Rolling back" (model
               runner weight_updater.py:225-236)
    flush      flush_cache=true fails the update while requests run (scheduler.py:5518-5547 with
               is_fully_idle(ignore_waiting=paused)): live requests under no pause or an in_place
               pause run; a retract pause moves them to the waiting queue (scheduler.py:5816-5900)
    version    on success the version moves (spans: scheduler.py:5636 record_weight_version_change;
               /model_info: tokenizer_control_mixin.py:529-531, 1072-1079); one version for both here,
               moved after the flush check (SGLang's scheduler moves its own before it); tp_size 1 in
               /server_info (build_server_info: ServerArgs.resolved_dict)
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tests.sglang.conftest import RecordingTokenizerManager

try:
    from sglang.srt.utils import MultiprocessingSerializer
except Exception:  # noqa: BLE001 - sglang missing: conftest.skip_without_sglang skips every user
    MultiprocessingSerializer = None

# the fixed tensor set the recorder's "model" holds: names and shapes of the tiny Llama's (tests/conftest.py)
HELD = {"model.norm.weight": (64,), "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.1.post_attention_layernorm.weight": (64,)}
GROUP_TIMEOUT = timedelta(seconds=60)  # SGLang passes none (30 min default); a test must not hang that long


class WeightRecorder(RecordingTokenizerManager):
    def __init__(self, server_args: Any, runner: ModelRunner | None, exit_with_runner: bool = False, **kw: Any):
        super().__init__(server_args=server_args, **kw)
        self.runner = runner.call if runner is not None else None
        if runner is not None and exit_with_runner:  # the whole server goes when its model runner dies
            self.runner = lambda *cmd: _or_exit(runner.call, *cmd)
        self.params = {n: torch.zeros(s) for n, s in HELD.items()}
        self.session: dict | None = None
        self.skipped: list[str] = []  # names load_weights ignored
        self.received_dtypes: list[str] = []  # the dtypes of every tensor a distributed update announced
        self.skip_silently: set[str] = set()  # names load_weights skips without a word (a tied lm_head ...)
        self.pause_mode: str | None = None

    async def pause_generation(self, obj: Any) -> None:
        self.pause_mode = obj.mode
        await super().pause_generation(obj)

    async def continue_generation(self, obj: Any) -> None:
        self.pause_mode = None
        await super().continue_generation(obj)

    # ---- group (in the model-runner process) --------------------------------------------------
    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        # managers/tokenizer_control_mixin.py:451, uncaught: Starlette's plain-text HTTP 500
        assert self.server_args.dp_size == 1, "data-parallel replicas are not supported for update weights from distributed"
        return await asyncio.to_thread(self.runner, "init", obj.backend, f"tcp://{obj.master_address}:{obj.master_port}",
                                       obj.world_size, obj.rank_offset + 0, obj.group_name)  # tp_rank 0

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await asyncio.to_thread(self.runner, "destroy", obj.group_name)

    # ---- session -------------------------------------------------------------------------
    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = {"loaded_weights": False}
        return True, "Success"

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    # ---- updates -------------------------------------------------------------------------
    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        assert self.server_args.dp_size == 1, "data-parallel replicas are not supported for update weights from distributed"
        self.received_dtypes.extend(obj.dtypes)
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if self.session is None:
            return False, ("update_weights_from_distributed must run between "
                           "begin_weight_update() and end_weight_update()")
        ok, weights = await asyncio.to_thread(self.runner, "receive", obj.names, obj.dtypes, obj.shapes, obj.group_name)
        if not ok:
            return False, f"Failed to receive weights: {weights}"
        return self._loaded(obj, *self._load(weights))

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if self.session is None:
            return False, ("update_weights_from_tensor must run between "
                           "begin_weight_update() and end_weight_update()")
        named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])  # tp rank 0's entry
        return self._loaded(obj, *self._load(named))

    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
        from safetensors.torch import load_file

        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        saved = {n: t.clone() for n, t in self.params.items()}
        try:
            root = Path(obj.model_path)
            files = sorted(set(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"].values()))
            ok, message = self._load([kv for f in files for kv in load_file(str(root / f)).items()])
        except Exception as e:  # noqa: BLE001
            ok, message = False, f"Failed to get weights iterator: {e}."
        if not ok:
            self.params = saved
            return False, message.replace("Failed to update parameter online", "Failed to update weights")
        return (*self._loaded(obj, True, "Succeeded to update model weights.", session=False), 0)

    async def get_weights_by_name(self, obj: Any, request: Any = None) -> list | None:
        """models/llama.py get_weights_by_name: the parameter as float32, `.tolist()[:truncate_size]`;
        None (the route's HTTP 400 "Get parameter by name failed") for a name the model does not map."""
        param = self.params.get(obj.name)
        return None if param is None else param.float().tolist()[:obj.truncate_size]

    # ---- the scheduler and model runner ------------------------------------------------------
    def _load(self, named: list) -> tuple[bool, str]:
        """LlamaForCausalLM.load_weights (models/llama.py:760-780, loader v1, the default): a name it
        does not hold is logged and skipped; default_weight_loader (model_loader/weight_utils.py:
        1574-1586) asserts the size and copies (converting the dtype)."""
        try:
            for name, w in named:
                if name in self.skip_silently:
                    continue
                if name not in self.params:
                    self.skipped.append(name)  # logger.warning(f"Parameter {name} not found in params_dict")
                    continue
                param = self.params[name]
                assert param.size() == w.size(), f"Attempted to load weight ({w.size()}) into parameter ({param.size()})"
                param.data.copy_(w)
        except Exception as e:  # noqa: BLE001
            return False, (f"Failed to update parameter online: {e!r}. The full weights of the ModelRunner "
                           "are partially updated. Please discard the whole weights.")
        return True, "Succeeded to update parameter online."

    def _loaded(self, obj: Any, ok: bool, message: str, session: bool = True) -> tuple[bool, str]:
        if not ok:
            return ok, message
        if session:
            self.session["loaded_weights"] = True
        if obj.flush_cache and not self.flushable():
            return False, ("Weights were updated, but the cache was not flushed because requests are still "
                           "running or queued. Retract or finish them, then call /flush_cache.")
        if obj.weight_version is not None:
            self.set_weight_version(obj.weight_version)
        return True, message + (f" Weight version updated to {obj.weight_version}." if obj.weight_version else "")

    def flushable(self) -> bool:
        """Scheduler.flush_cache: idle unless requests run (a retract or abort pause stops them)."""
        return not self.live or self.pause_mode in ("retract", "abort")


def _or_exit(call: Any, *cmd: Any) -> Any:
    try:
        return call(*cmd)
    except (EOFError, OSError):
        os._exit(1)


class ModelRunner:
    """The model-runner process (spawned: SGLang's scheduler is a process of its own, so the sender's
    rank 0 and this rank do not share torch.distributed's group registry). Serial, as the scheduler is;
    group names are unique per sync, so one process serves every test."""

    def __init__(self, group_timeout: timedelta | None = GROUP_TIMEOUT):
        """`group_timeout` None: SGLang's own (it passes none: torch's default, 30 minutes)."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=model_runner, args=(child, group_timeout), daemon=True)
        self.proc.start()
        self.lock = threading.Lock()
        self.call("groups")  # imported and answering

    def call(self, *cmd: Any) -> Any:
        with self.lock:
            self.conn.send(cmd)
            return self.conn.recv()

    def close(self) -> None:
        with self.lock:
            self.conn.send(("stop",))
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def model_runner(conn: Any, group_timeout: timedelta | None) -> None:
    """ModelRunner's process: the update groups and their broadcasts. ("die_after", n): the process
    exits (os._exit) once it has received n tensors of a later broadcast: killed mid-broadcast."""
    from sglang.srt.utils.common import init_custom_process_group

    groups: dict[str, Any] = {}
    die_after: int | None = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        if cmd == "init":
            backend, init_method, world_size, rank, name = args
            try:
                groups[name] = init_custom_process_group(backend=backend, init_method=init_method, timeout=group_timeout,
                                                         world_size=world_size, rank=rank, group_name=name)
                conn.send((True, "Succeeded to initialize custom process group."))
            except Exception as e:  # noqa: BLE001 - SGLang answers every failure as a message
                conn.send((False, f"Failed to initialize custom process group: {e}."))
        elif cmd == "destroy":
            if args[0] in groups:
                torch.distributed.destroy_process_group(groups.pop(args[0]))
                conn.send((True, "Succeeded to destroy custom process group."))
            else:
                conn.send((False, "The group to be destroyed does not exist."))
        elif cmd == "groups":
            conn.send(sorted(groups))
        elif cmd == "die_after":
            die_after = args[0]
            conn.send(True)
        elif cmd == "receive":
            names, dtypes, shapes, name = args
            if name not in groups:
                conn.send((False, f"Group {name} not in {sorted(groups)}. Please call `init_weights_update_group` first."))
                continue
            try:
                weights = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
                for i, h in enumerate([torch.distributed.broadcast(w, src=0, group=groups[name], async_op=True)
                                       for _, w in weights]):
                    if die_after is not None and i >= die_after:
                        os._exit(1)
                    h.wait()
                conn.send((True, weights))
            except Exception as e:  # noqa: BLE001
                conn.send((False, str(e)))
