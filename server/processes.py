"""The processes the server side launches.

`ServerProcess` is the base of tritonserver (`triton.TritonServer`): it starts a command as the
leader of its own process group, its output in a log file and the parent-death signal set (a
launcher killed without stop() takes it along); waits for readiness while checking that the process
is alive; and stops the whole group (its Python stubs) and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

# Log lines that make a tail useful: the option tables Triton prints at start-up are not.
_TABLE_LINE_PREFIXES = ("|", "+-")


class ServerError(RuntimeError):
    """The server could not be found, prepared, started, or did not become ready."""


def log_tail(path: Path | str | None, lines: int = 40) -> str:
    """The last `lines` meaningful lines of a server log (start-up option tables left out)."""
    if path is None:
        return "(no log)"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    kept = [
        line
        for line in text.splitlines()
        if line.strip() and not line.startswith(_TABLE_LINE_PREFIXES)
    ]
    return "\n".join(kept[-lines:]) if kept else "(log is empty)"


def http_ready(url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 200, else what it answered ("HTTP 503", the connection error)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (urllib.error.URLError, ConnectionError, OSError) as error:
        return str(error)


# A Python model whose stub process died (a segfault, the OOM killer) leaves tritonserver answering
# ready, and its model ready, while every request to it fails with "Stub process '<instance>' is not
# healthy": only a request shows it. The probes, on a sequence id no client uses (2^64 - 1): code2wav's
# START+END request without frames, which its stub answers without calling the decoder, and one
# START+END step of silence for the decoder (a Python stub with python-ort and null; a step of the
# native ones). docker/triton-watchdog.sh sends the first.
STUB_PROBE_SEQUENCE_ID = 2**64 - 1
STUB_PROBES = {
    "code2wav": {"name": "input_ids", "shape": [1, 0], "datatype": "INT64", "data": []},
    "mimi_decoder": {"name": "codes", "shape": [1, 8, 1], "datatype": "INT32", "data": [0] * 8},
}
DEAD_STUB = "is not healthy"


def dead_stub(http_url: str, timeout_s: float, headers: dict[str, str] | None = None) -> str | None:
    """The server's error when the Python stub of code2wav or of the decoder at `http_url` (host:port)
    is dead; None when each answered anything else (a result, a refusal while it drains or loads, no
    such model) or nothing. `headers`: the inference key's, where the server requires it."""
    for model, probe in STUB_PROBES.items():
        body = json.dumps({
            "parameters": {"sequence_id": STUB_PROBE_SEQUENCE_ID, "sequence_start": True, "sequence_end": True},
            "inputs": [probe],
        }).encode()
        request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/infer", data=body,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                continue
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            if DEAD_STUB in text:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    text = json.loads(text)["error"]
                return text
        except (urllib.error.URLError, ConnectionError, OSError):
            continue
    return None


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(process: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM `process` (the leader of its own process group), SIGKILL the group if it has not
    exited after `grace_s`, then wait until the rest of the group (Python stubs) is
    gone too, killing it after 5 s. Idempotent; returns the leader's exit code."""
    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def wait_group(timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while process_group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_group()
            process.wait()
    # The rest of the group notices its leader is gone and exits; give it a moment, then make sure.
    wait_group(5.0)
    if process_group_alive(process.pid):
        kill_group()
        wait_group(5.0)
    return process.returncode


def with_parent_death_signal(command: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """`command` (and a preexec_fn) such that Linux SIGTERMs the child when this process dies
    (PR_SET_PDEATHSIG): so a launcher killed without stop() (SIGKILL, a test timeout) takes its
    server along.

    util-linux's `setpriv --pdeathsig TERM --` sets it and execs the command (same pid), so no
    Python code runs in the forked child. A preexec_fn would: Python then runs its at-fork hooks
    there, which in a process with threads can crash the child before exec (seen: a SIGSEGV in a
    library's at-fork handler, reported as the server dying at once with an empty log). Without
    setpriv, the preexec_fn is the fallback; without either, stop() remains the only way."""
    setpriv = shutil.which("setpriv") or next((path for path in ("/usr/bin/setpriv", "/bin/setpriv")
                                                if os.access(path, os.X_OK)), None)
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *command], None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return list(command), None
    set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return list(command), lambda: prctl(set_pdeathsig, sigterm, 0, 0, 0)


class ServerProcess:
    """One server process on `host` (gRPC and HTTP ports; None or 0: picked free at start), the
    leader of its own process group, its output in `log_path`.

    A subclass says what to run (`_prepare`), when it is ready (`readiness`), and how its logs read
    in an error (`log_report`). `start()` returns at once, `wait_ready()` polls `readiness` while
    checking that the process is alive, `stop()` ends the group; or use it as a context manager.
    """

    name = "server"  # in messages
    error: type[ServerError] = ServerError
    ready_timeout_s = 60.0
    stop_grace_s = 10.0

    def __init__(self, *, host: str, grpc_port: int | None, http_port: int | None, log_path: Path | str | None):
        self.host = host
        # 0 means "any free port", as for a socket bind.
        self.grpc_port = grpc_port or None
        self.http_port = http_port or None
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """The exit code once the process has exited (negative: killed by that signal), else None."""
        return self.process.poll() if self.process is not None else None

    # What a subclass defines -------------------------------------------------------------------
    def _prepare(self) -> tuple[list[str], dict[str, str] | None]:
        """Everything before the launch (ports, files, checks); returns the command and its
        environment (None: this one's). Sets `log_path` if it is None."""
        raise NotImplementedError

    def readiness(self) -> str | None:
        """None once the server is ready, else what the check saw (said when the wait times out)."""
        raise NotImplementedError

    def log_report(self) -> str:
        """The log's name and tail, for an error message."""
        return f"(log {self.log_path}):\n{log_tail(self.log_path)}"

    def exit_cause(self) -> str:
        """Why the process exited, when its log says (": ..."), else ""."""
        return ""

    # Lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch the process (returns at once; see `wait_ready`). Its output goes to `log_path`."""
        if self.process is not None:
            raise self.error(f"this {type(self).__name__} was already started")
        command, env = self._prepare()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command, preexec_fn = with_parent_death_signal(command)
        with open(self.log_path, "wb") as log:
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group: Ctrl-C in a terminal does not reach it, and stop() can end it
                # together with its children (Python stubs) and nothing else.
                start_new_session=True,
                # If this process dies without stop() (SIGKILL, a test timeout), the server follows.
                preexec_fn=preexec_fn,
            )

    def wait_ready(self, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Poll `readiness()` until it says ready; returns seconds since `start()`.

        Raises the class's `error` with the log tail if the process exits first, or if it is not
        ready within `timeout_s` (default `ready_timeout_s`). Does not stop the server.
        """
        self.ready_after_s = self.wait_until(
            self.readiness, self.ready_timeout_s if timeout_s is None else timeout_s, poll_s
        )
        return self.ready_after_s

    def wait_until(
        self, check: Callable[[], str | None], timeout_s: float, poll_s: float = 0.05, what: str | None = None
    ) -> float:
        """Poll `check()` (None: ready, else what it saw) while the process lives; returns seconds since
        `start()`. Raises `error` with the log tail when the process exits first or `timeout_s` passes
        (`what` names what was not ready in that message; default the server's name)."""
        if self.process is None:
            raise self.error("wait_ready() before start()")
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise self.error(
                    f"{self.name} exited with code {code} before it was ready{self.exit_cause()} {self.log_report()}"
                )
            seen = check()
            if seen is None:
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                raise self.error(
                    f"{what or self.name} was not ready after {timeout_s:.0f} s: {seen} {self.log_report()}"
                )
            time.sleep(poll_s)

    def start_ready(self) -> float:
        """`start()`, then `wait_ready()` with its defaults."""
        self.start()
        return self.wait_ready()

    def __enter__(self):
        """`start_ready()` (and `stop()` if that fails); `stop()` on exit."""
        try:
            self.start_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the process exits by itself; returns its exit code."""
        if self.process is None:
            raise self.error("wait() before start()")
        return self.process.wait(timeout_s)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the process, SIGKILL its process group after `grace_s` (default `stop_grace_s`),
        and wait until the rest of the group is gone too. Idempotent; returns the exit code (None if
        never started)."""
        if self.process is None:
            return None
        return stop_process_group(self.process, self.stop_grace_s if grace_s is None else grace_s)
