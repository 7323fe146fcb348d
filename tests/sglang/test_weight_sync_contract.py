"""asyncrl's real WeightSender against SGLang 0.5.23's real HTTP app (weight_recorder.py: the recorder
backend joins the gloo update group and receives the broadcast) and, with the same scenarios and the
same assertion helpers, against a real embedded engine process (the tiny model). The sglang variant
carries the `sglang` mark and skips where sglang is not importable; the embedded one runs everywhere
the tiny model does.

The one difference: the recorder holds a fixed tensor set (weight_recorder.HELD), so there the test
also checks it holds exactly what was sent; the embedded engine holds a whole model, whose weights
after a sync tests/weight_sync/test_sync.py checks token by token.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from asyncrl.engine.base import SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.util.auth import auth_headers
from asyncrl.weight_sync import WeightMismatchError, WeightSender, WeightSyncError
from asyncrl.weight_sync.broadcast import GroupTransport
from asyncrl.weight_sync.disk import DiskTransport
from asyncrl.weight_sync.tensor import TensorTransport
from tests.sglang.conftest import SGLangApp, skip_without_sglang
from tests.sglang.weight_recorder import HELD, ModelRunner, WeightRecorder

pytestmark = pytest.mark.timeout(180)


@dataclass
class Engine:
    kind: str  # "sglang" (SGLang's app, recorder backend) | "embedded"
    url: str
    weights_dir: Path  # where a disk sync may write (the embedded engine loads only below it)
    tm: WeightRecorder | None = None  # the recorder, for the sglang variant

    async def decoding(self) -> bool:
        """Whether a request is producing tokens now."""
        if self.tm is not None:
            return self.tm.tokens_out >= 5
        async with httpx.AsyncClient(trust_env=False) as h:
            return (await h.get(self.url + "/stats")).json()["running"] > 0


@pytest.fixture(scope="session")
def model_runner() -> Iterator[ModelRunner]:
    runner = ModelRunner()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def embedded_engine(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """One embedded engine process for the module's embedded variants (a launch costs seconds to tens of
    seconds on 2 cores); `engine` puts it back to the tiny model's weights at version 0 after each test."""
    root = tmp_path_factory.mktemp("embedded_weights")
    proc = launch_embedded(tiny_model_dir, threads=1, weights_dirs=[root])
    try:
        yield proc.url, root
    finally:
        proc.stop()


def original_held(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny model's own values of the HELD tensors (what the shared engine starts with)."""
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n).float() for n in HELD}


@pytest.fixture(params=[pytest.param("sglang", marks=[pytest.mark.sglang, skip_without_sglang]), "embedded"])
def engine(request, tmp_path) -> Iterator[Engine]:
    if request.param == "sglang":
        tm = WeightRecorder(request.getfixturevalue("sglang_config"), request.getfixturevalue("model_runner"))
        with SGLangApp(tm) as app:
            yield Engine("sglang", app.url, tmp_path, tm)
        return
    url, root = request.getfixturevalue("embedded_engine")
    weights_dir = Path(tempfile.mkdtemp(dir=root))  # below the engine's weights root, fresh per test
    yield Engine("embedded", url, weights_dir)
    # whatever the test did (version, weights, a session or pause left open), the next test finds the
    # engine as launched: the sender ends a stale session and always continues generation; then checked
    restore = WeightSender(DiskTransport(str(weights_dir / "restore"), timeout_s=60), timeout_s=60)
    original = original_held(request.getfixturevalue("tiny_model_dir"))
    report = asyncio.run(synced(Engine("embedded", url, weights_dir), restore, original, 0))
    assert report.ok, f"could not put the shared embedded engine back to version 0: {report}"
    assert_idle_at(Engine("embedded", url, weights_dir), 0)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in HELD.items()}


def buckets(named: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    items = list(named.items())
    return [items[:2], items[2:]]  # two buckets: only the last one carries the version


def gloo() -> WeightSender:
    return WeightSender(GroupTransport("gloo", timeout_s=60), timeout_s=60)


async def synced(engine: Engine, sender: WeightSender, named: dict[str, torch.Tensor], version: int):
    await sender.connect([engine.url])
    try:
        return await sender.sync(iter(buckets(named)), version=version)
    finally:
        await sender.close()


# ---- the contract, checked the same way on both engines ------------------------------------------

def assert_idle_at(engine: Engine, version: int) -> None:
    """/model_info reports `version` (a string); no session is open (end is refused with SGLang's 400);
    generation runs (not paused) and reports the version."""
    info = httpx.get(engine.url + "/model_info", timeout=10).json()
    assert info["weight_version"] == str(version), info
    r = httpx.post(engine.url + "/end_weight_update", json={}, timeout=10, headers=auth_headers())
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    r = httpx.post(engine.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                   timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == str(version), r.text


def assert_holds(engine: Engine, named: dict[str, torch.Tensor]) -> None:
    """The recorder holds exactly the sent tensors (the embedded engine: test_sync.py's token checks)."""
    if engine.tm is not None:
        assert engine.tm.params.keys() == named.keys()
        assert all(torch.equal(engine.tm.params[n], t) for n, t in named.items())


# ---- scenarios --------------------------------------------------------------------------------------

async def test_distributed_sync_sets_the_version_and_the_tensors(engine):
    sent, sender = tensors(1), gloo()
    await sender.connect([engine.url])
    try:
        report = await sender.sync(iter(buckets(sent)), version=3)
        group = sender.transport.group_name
    finally:
        await sender.close()
    assert report.ok and report.engines_ok == [engine.url] and report.buckets == 2
    assert report.collectives == len(sent) or engine.kind == "embedded"  # SGLang: one broadcast per tensor
    assert_idle_at(engine, 3)
    assert_holds(engine, sent)
    if engine.tm is not None:
        assert group and group not in engine.tm.runner("groups")  # close() destroyed it on SGLang's side too


async def test_wrong_shape_is_refused_400_and_the_session_is_still_ended(engine):
    good = tensors(2)
    assert (await synced(engine, gloo(), good, 5)).ok
    bad = {**tensors(3), "model.norm.weight": torch.zeros(3)}
    with pytest.raises(WeightMismatchError) as err:
        await synced(engine, gloo(), bad, 6)
    assert err.value.code == "refused" and err.value.status == 400 and err.value.url == engine.url
    if engine.tm is not None:
        assert "Failed to update parameter online" in err.value.message and "torch.Size([3])" in err.value.message
    else:
        assert "model.norm.weight" in err.value.message
    assert_idle_at(engine, 5)


async def test_an_unknown_tensor_name_stops_the_sync_before_its_bucket_moves(engine):
    """SGLang's Llama loader skips a name it does not hold and answers success (the recorder's _load, as
    models/llama.py): the version would move while the weights never change. The sender asks for every
    name of a bucket with /get_weights_by_name before the engine's first bucket and stops."""
    named = {**tensors(4), "model.not_a_layer.weight": torch.zeros(64)}
    with pytest.raises(WeightMismatchError) as err:
        await synced(engine, gloo(), named, 7)
    assert err.value.url == engine.url and "model.not_a_layer.weight (not held by the served model)" in err.value.message
    assert_idle_at(engine, 0)
    if engine.tm is not None:
        assert engine.tm.skipped == []  # the unknown name never reached the loader
        unchecked = gloo()  # what a sender that does not check names (main before this) got: "ok"
        unchecked.verified.add(engine.url)
        unchecked.verify_every = 0
        assert (await synced(engine, unchecked, named, 7)).ok and engine.tm.skipped == ["model.not_a_layer.weight"]


async def test_a_tensor_the_engine_answered_but_did_not_load_is_found_after_the_sync(engine):
    """One tensor per sync is read back (trainer.weight_sync.verify_every=1). The recorder's loader skips
    model.norm.weight silently, as SGLang's skips a tied lm_head or a rotary buffer it still maps for
    /get_weights_by_name; the embedded engine loads it and the same check passes."""
    sent = tensors(8)
    if engine.tm is not None:
        engine.tm.skip_silently = {"model.norm.weight"}
        with pytest.raises(WeightMismatchError) as err:
            await synced(engine, gloo(), sent, 9)
        assert "model.norm.weight on the engine is not what was sent" in err.value.message
        return
    sender = gloo()
    report = await synced(engine, sender, sent, 9)
    assert report.ok and sender._sample is not None and sender._sample[0] == "model.norm.weight"
    assert_idle_at(engine, 9)


async def test_control_routes_need_the_token_and_generation_stays_open(engine):
    """SGLang with --admin-api-key (its own middleware, conftest) and the embedded engine refuse alike."""
    control = [("/abort_request", {"abort_all": True}), ("/pause_generation", {"mode": "abort"}),
               ("/begin_weight_update", {}), ("/update_weights_from_disk", {"model_path": "/etc"}),
               ("/init_weights_update_group", {"master_address": "203.0.113.9", "master_port": 29500,
                                               "rank_offset": 1, "world_size": 2, "group_name": "g", "backend": "gloo"})]
    async with httpx.AsyncClient(timeout=30, trust_env=False) as h:
        for path, body in control:
            for headers in ({}, {"Authorization": "Bearer " + "x" * 43}):
                r = await h.post(engine.url + path, json=body, headers=headers)
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (engine.kind, path, r.text)
        assert (await h.get(engine.url + "/model_info")).status_code == 200
    assert_idle_at(engine, 0)  # nothing changed; /generate answers without a token


async def test_disk_sync_needs_no_session(engine):
    sent = tensors(4)
    sender = WeightSender(DiskTransport(str(engine.weights_dir), timeout_s=60), timeout_s=60)
    report = await synced(engine, sender, sent, 4)
    assert report.ok and report.buckets == 2 and (engine.weights_dir / "v4" / "model.safetensors.index.json").is_file()
    assert_idle_at(engine, 4)
    assert_holds(engine, sent)


async def test_tensor_transport(engine):
    if not torch.cuda.is_available():
        pytest.skip("TensorTransport sends CUDA-IPC handles (ForkingPickler of CUDA tensors) and refuses "
                    "to prepare without a GPU; CPU tensors would be pickled as shared-memory copies, "
                    "which is not the colocated path it exists for")
    sent = tensors(5)
    report = await synced(engine, WeightSender(TensorTransport(timeout_s=60), timeout_s=60), sent, 8)
    assert report.ok
    assert_idle_at(engine, 8)
    assert_holds(engine, {n: t.cuda().cpu() for n, t in sent.items()})


async def test_a_session_left_open_by_a_dead_sender_is_closed_and_reopened(engine):
    r = httpx.post(engine.url + "/begin_weight_update", json={}, timeout=10, headers=auth_headers())
    assert r.status_code == 200 and r.json()["success"] is True
    r = httpx.post(engine.url + "/begin_weight_update", json={}, timeout=10, headers=auth_headers())  # a second begin: refused
    assert r.status_code == 400 and r.json()["success"] is False
    sent = tensors(6)
    report = await synced(engine, gloo(), sent, 2)
    assert report.ok
    assert_idle_at(engine, 2)
    assert_holds(engine, sent)


@pytest.mark.parametrize("mode,continued", [("in_place", 0), ("abort", 1)])
async def test_a_generation_spanning_the_sync_reports_both_versions(engine, mode, continued):
    """in_place (SGLang's retract): the request is kept; abort: cut short, and EngineClient continues it."""
    n = 1500
    sender = WeightSender(GroupTransport("gloo", timeout_s=60), timeout_s=60, mode=mode)
    await sender.connect([engine.url])  # the group is built before the request starts
    try:
        async with EngineClient(engine.url) as client:
            sp = SamplingParams(temperature=0.0, max_new_tokens=n, min_new_tokens=n)
            task = asyncio.ensure_future(client.generate([1, 2, 3], sp))
            while not await engine.decoding():
                await asyncio.sleep(0.01)
            assert (await sender.sync(iter(buckets(tensors(7))), version=1)).ok
            res = await task
    finally:
        await sender.close()
    assert res.finish_reason == "length" and len(res.output_ids) == n and client.continued == continued
    k = res.versions.index(1)
    assert 0 < k < n and res.versions == [0] * k + [1] * (n - k) and res.weight_version == 1


@pytest.mark.parametrize("path,body", [
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                          "group_name": "g", "weight_version": "9"}),
    ("/end_weight_update", {}),
    ("/destroy_weights_update_group", {"group_name": "no-such-group"}),
], ids=["update-outside-session", "end-without-begin", "destroy-unknown-group"])
def test_refusals_are_sglangs_400_with_success_false(engine, path, body):
    r = httpx.post(engine.url + path, json=body, timeout=10, headers=auth_headers())
    assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"], r.text
    assert httpx.get(engine.url + "/model_info", timeout=10).json()["weight_version"] == "0"


@pytest.mark.parametrize("body", [{"names": "model.norm.weight"}, {"dtypes": ["float32"]}, [1, 2]],
                         ids=["names-not-a-list", "no-names", "not-an-object"])
def test_malformed_update_is_a_4xx_without_success(engine, body):
    """A body SGLang cannot parse never reaches the backend: an error object, no "success" key, which
    the sender classifies as its own configuration error (engine_http.classify)."""
    r = httpx.post(engine.url + "/update_weights_from_distributed", json=body, timeout=10, headers=auth_headers())
    assert 400 <= r.status_code < 500 and "success" not in r.json(), r.text
    assert httpx.get(engine.url + "/model_info", timeout=10).json()["weight_version"] == "0"


@pytest.mark.sglang
@skip_without_sglang
async def test_flush_with_requests_running_fails_the_update_so_the_sender_pauses_with_retract(
        sglang_config, model_runner):
    """Why trainer.weight_sync.mode=in_place is sent as SGLang's "retract": under an in_place pause the
    requests keep their batch, and an update with flush_cache=true answers 400 (SGLang's scheduler)."""
    tm = WeightRecorder(sglang_config, model_runner)
    with SGLangApp(tm) as app:
        sender = gloo()
        await sender.connect([app.url])
        try:
            async with EngineClient(app.url, max_abort_rounds=0) as client:  # the abort below ends it
                task = asyncio.ensure_future(client.generate([1], SamplingParams(max_new_tokens=100000)))
                while tm.tokens_out < 5:
                    await asyncio.sleep(0.01)
                body = {"names": [], "dtypes": [], "shapes": [], "group_name": sender.transport.group_name,
                        "weight_version": "1", "flush_cache": True}
                async with httpx.AsyncClient(base_url=app.url, timeout=30, headers=auth_headers()) as h:
                    replies = {}
                    for mode in ("in_place", "retract"):
                        assert (await h.post("/pause_generation", json={"mode": mode})).status_code == 200
                        assert (await h.post("/begin_weight_update", json={})).status_code == 200
                        replies[mode] = await h.post("/update_weights_from_distributed", json=body)
                        assert (await h.post("/end_weight_update", json={})).status_code == 200
                    r = replies["in_place"]
                    assert r.status_code == 400 and "cache was not flushed" in r.json()["message"], r.text
                    r = replies["retract"]
                    assert r.status_code == 200 and r.json()["success"] is True and tm.weight_version == "1", r.text
                    await h.post("/abort_request", json={"abort_all": True})
                    await h.post("/continue_generation", json={})
                await task
        finally:
            await sender.close()


@pytest.mark.sglang
@skip_without_sglang
@pytest.mark.timeout(300)
async def test_an_engine_killed_mid_broadcast_frees_the_survivor_and_the_group_reforms(sglang_config):
    """Two SGLang apps whose model runners join with SGLang's own group timeout (it gives none: torch's
    30 minutes): A in this process, B in its own (recorder_server.py), whose runner dies after the
    first tensor of the bucket, taking B's server with it. A must leave its receive within
    trainer.weight_sync.timeout_s, not 30 minutes, and the next sync re-forms the group without B."""
    import subprocess
    import sys
    import time

    runner = ModelRunner(group_timeout=None)
    tm = WeightRecorder(sglang_config, runner)
    b = subprocess.Popen([sys.executable, "-m", "tests.sglang.recorder_server", "--die-after", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    timeout_s = 10.0
    try:
        b_url = b.stdout.readline().strip()
        assert b_url.startswith("http://"), f"recorder_server did not start (exit {b.poll()})"
        with SGLangApp(tm) as a:
            sender = WeightSender(GroupTransport("gloo", timeout_s=timeout_s), timeout_s=timeout_s)
            await sender.connect([b_url, a.url])  # B is rank 1: rank 0 sends to it first, then to A
            try:
                t0 = time.monotonic()
                report = await sender.sync(iter([list(tensors(12).items())]), version=2)
                assert not report.ok and b_url in report.engines_failed, report
                await asyncio.to_thread(runner.call, "groups")  # A's runner left its receive
                freed_s = time.monotonic() - t0
                assert freed_s < timeout_s + 10, f"the survivor stayed in its receive {freed_s:.0f}s"
                assert b.wait(timeout=30) == 1  # B's server went with its runner
                report = await sender.sync(iter([list(tensors(13).items())]), version=3)
                assert report.engines_ok == [a.url] and b_url in report.engines_failed, report
            finally:
                await sender.close()
            engine = Engine("sglang", a.url, Path("."), tm)
            assert_idle_at(engine, 3)
            assert_holds(engine, tensors(13))
    finally:
        b.kill()
        b.wait()
        runner.close()


@pytest.mark.sglang
@skip_without_sglang
async def test_data_parallel_replicas_are_refused_naming_dp_size(sglang_config, model_runner):
    """SGLang asserts dp_size == 1 in its update routes (HTTP 500, which reads as a dead engine, left out
    of every sync); the sender reads dp_size from /server_info first and stops, naming it."""
    import copy

    args = copy.copy(sglang_config)
    args.dp_size = 2
    with SGLangApp(WeightRecorder(args, model_runner)) as app:
        assert httpx.get(app.url + "/server_info", timeout=10).json()["dp_size"] == 2
        body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                "group_name": "g", "backend": "gloo"}
        r = httpx.post(app.url + "/init_weights_update_group", json=body, timeout=10, headers=auth_headers())
        assert r.status_code == 500  # SGLang's own answer, what the sender used to read as "unreachable"
        sender = gloo()
        try:
            with pytest.raises(WeightSyncError) as err:
                await sender.connect([app.url])
        finally:
            await sender.close()
    assert err.value.code == "config" and "dp_size=2" in err.value.message and err.value.url == app.url


@pytest.mark.sglang
@skip_without_sglang
async def test_floating_tensors_go_in_the_dtype_sglang_serves(sglang_config, model_runner):
    """SGLang has no /weight_sync_info; its /server_info dtype (bfloat16 here) is what it serves, so an
    fp32 learner sends bf16: half the bytes, the values SGLang's loader would have made of fp32 ones."""
    import copy

    args = copy.copy(sglang_config)
    args.dtype = "bfloat16"
    tm = WeightRecorder(args, model_runner)
    sent = tensors(14)
    with SGLangApp(tm) as app:
        assert httpx.get(app.url + "/server_info", timeout=10).json()["dtype"] == "bfloat16"
        report = await synced(Engine("sglang", app.url, Path("."), tm), gloo(), sent, 4)
    assert report.ok and tm.received_dtypes == ["bfloat16"] * len(sent)
    assert report.bytes == sum(t.numel() * 2 for t in sent.values())
    assert all(torch.equal(tm.params[n], t.to(torch.bfloat16).float()) for n, t in sent.items())


@pytest.mark.sglang
@skip_without_sglang
async def test_a_refused_cache_flush_is_reported_as_such_not_as_a_mismatch(sglang_config, model_runner):
    """SGLang refuses the flush that ends an update while requests still run (here: paused in_place, as an
    operator or a racing pause would leave it) after the tensors loaded: HTTP 400, success=false, the
    version not moved. That engine is left out of the sync as flush_refused, not a WeightMismatchError
    (its names and shapes were right) that would stop the run."""
    tm = WeightRecorder(sglang_config, model_runner)
    sent = tensors(15)
    with SGLangApp(tm) as app:
        sender = gloo()
        sender.pause_mode = "in_place"  # the requests keep running through the update
        await sender.connect([app.url])
        try:
            async with EngineClient(app.url, max_abort_rounds=0) as client:
                task = asyncio.ensure_future(client.generate([1], SamplingParams(max_new_tokens=100000)))
                while tm.tokens_out < 5:
                    await asyncio.sleep(0.01)
                report = await sender.sync(iter(buckets(sent)), version=1)
                httpx.post(app.url + "/abort_request", json={"abort_all": True}, timeout=10, headers=auth_headers())
                await task
        finally:
            await sender.close()
    err = report.engines_failed[app.url]
    assert not report.ok and err.code == "flush_refused" and "cache was not flushed" in err.message
    assert {n: torch.equal(tm.params[n], t) for n, t in sent.items()} == dict.fromkeys(sent, True), tm.skipped
    assert tm.weight_version == "0"
