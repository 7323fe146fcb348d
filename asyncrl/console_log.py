"""The run's console record: what `asyncrl train` printed (its stdout and stderr, log lines included)
is also appended to `<run dir>/train.log`, and the overrides typed on the command line are written to
`<run dir>/overrides.yaml` (a YAML list, as Hydra's `.hydra/overrides.yaml`).

Secrets never reach either file: the values of the secret environment variables the run withheld
(asyncrl/secrets.py `SECRET_ENV`) are replaced by `REDACTED` wherever they appear in a line, and an
override whose key names a secret is written with its value redacted. The record is this process's
Python-level streams: output that a child process writes straight to the inherited terminal (an engine
server's own stderr) is in that child's log file under the run dir instead.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import IO, Optional

from asyncrl.run_dir import RunLayout
from asyncrl.secrets import REDACTED, is_secret

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # `asyncrl train`'s log lines, in every process


class _Tee:
    """A text stream writing to `stream` and, redacted, to `log`."""

    def __init__(self, stream: IO[str], log: Optional[IO[str]], secrets: list[str]):
        self.stream, self.log, self.secrets = stream, log, secrets

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        self.record(text)
        return n

    def record(self, text: str) -> None:
        """`text`, redacted, into the log alone."""
        if self.log is None:
            return
        clean = text
        for s in self.secrets:
            clean = clean.replace(s, REDACTED)
        try:
            self.log.write(clean)
        except ValueError:  # the log was closed under a late writer (a thread at exit): the console still gets it
            pass
        except OSError as e:  # a full disk: the console goes on, the record stops here (said once per stream)
            self._stop(e)

    def flush(self) -> None:
        self.stream.flush()
        if self.log is None:
            return
        try:
            self.log.flush()
        except ValueError:
            pass
        except OSError as e:
            self._stop(e)

    def _stop(self, e: OSError) -> None:
        self.log = None
        self.stream.write(f"asyncrl: the console record (train.log) stops here: {e}\n")

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class ConsoleLog:
    """`with ConsoleLog(run_dir, secret_values):` tees sys.stdout and sys.stderr (and the logging handlers
    that write to them) into run_dir/train.log for the duration of the block."""

    def __init__(self, run_dir: Path, secret_values: list[str], banner: Optional[str] = "asyncrl train started"):
        self.path = RunLayout(Path(run_dir)).train_log
        self.banner = banner  # the line that opens this block's part of the record (None: none)
        self.secrets = [s for s in secret_values if s]
        self._file: Optional[IO[str]] = None
        self._saved: list[tuple[logging.StreamHandler, IO[str]]] = []

    def __enter__(self) -> ConsoleLog:
        self._file = open(self.path, "a", encoding="utf-8", errors="replace", buffering=1)
        self._out, self._err = sys.stdout, sys.stderr
        out, err = _Tee(self._out, self._file, self.secrets), _Tee(self._err, self._file, self.secrets)
        if self.banner:
            out.record(f"==== {self.banner} {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
            err.log = out.log  # a record that stopped at the banner stays stopped
        sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in (self._out, self._err):
                self._saved.append((h, h.stream))
                h.setStream(sys.stderr if h.stream is self._err else sys.stdout)
        return self

    def __exit__(self, *exc: object) -> None:
        for h, stream in self._saved:
            h.setStream(stream)
        sys.stdout, sys.stderr = self._out, self._err
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # a full disk: what the record missed, the console had
                pass


def write_overrides(run_dir: Path, overrides: list[str]) -> Path:
    """The overrides as typed, one YAML list item each (a secret-named key's value redacted)."""
    lines = []
    for ov in overrides:
        key, sep, _ = ov.partition("=")
        shown = f"{key}={REDACTED}" if sep and is_secret(key.lstrip("+~")) else ov
        lines.append("- " + _yaml_quote(shown))
    path = RunLayout(Path(run_dir)).overrides
    path.write_text("\n".join(lines) + ("\n" if lines else "[]\n"))
    return path


def _yaml_quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"
