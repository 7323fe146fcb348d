"""Who may join the Ray instance a run starts (asyncrl/run/ray_auth.py), on real Ray processes: a process of
the same host without the run's token cannot join it, not even with the token in `~/.ray/auth_token` that
Ray keeps for its own local clusters; one with the run's token can (so the refusal is the token's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.run.ray_auth import MODE_ENV, TOKEN_ENV, readable_token_file

pytestmark = pytest.mark.timeout(240)

HEAD = """
import os, sys, ray
from asyncrl.run.ray_auth import private_local_ray
private_local_ray()
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
print(ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN"], flush=True)
sys.stdin.readline()
ray.shutdown()
"""

JOIN = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("joined:", ray.get(ray.remote(lambda: "ran").remote(), timeout=60), flush=True)
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**base, "HOME": str(home), **extra}


def test_only_a_process_with_the_runs_token_joins_its_ray_instance(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("a-token-some-other-ray-cluster-uses")
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(home), start_new_session=True)
    try:
        line = head.stdout.readline()
        assert line.strip(), head.stderr.read()[-3000:]
        address, token = line.split()
        assert token != "a-token-some-other-ray-cluster-uses"

        def join(where: Path, **extra: str) -> subprocess.CompletedProcess:
            # a refused client retries its first GCS call once a second, 20 times by default: 3 are enough
            return subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True, text=True,
                                  env=_env(where, RAY_gcs_server_port_wait_time_s="3", **extra), timeout=120)

        bare = tmp_path / "bare"  # a home without any Ray token
        bare.mkdir()
        for where in (home, bare):  # Ray's own token file; no token at all
            r = join(where)
            assert r.returncode != 0 and "joined" not in r.stdout, (where, r.stdout[-1000:], r.stderr[-2000:])
        r = join(bare, **{MODE_ENV: "token", TOKEN_ENV: token})
        assert "joined: ran" in r.stdout, r.stderr[-3000:]
        head.stdin.write("\n")
        head.stdin.flush()
        head.wait(timeout=60)
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_a_token_file_others_may_read_is_reported(tmp_path):
    assert readable_token_file(tmp_path) is None  # none there
    path = tmp_path / ".ray" / "auth_token"
    path.parent.mkdir()
    path.write_text("t")
    path.chmod(0o644)
    assert readable_token_file(tmp_path) == (f"{path} has mode 0o644: other local users may read it and join any Ray "
                                             f"cluster that uses it (this run's own Ray instance does not); "
                                             f"chmod 600 {path}")
    path.chmod(0o600)
    assert readable_token_file(tmp_path) is None

