"""The project's one restart policy (docs/design.md §5.2): `code2wav-server serve`'s supervisor, and
`running_server`, the library call that the tests and benchmarks start servers with."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from .processes import ServerError, log_tail, report
from .triton import TritonServer

# A server that lived at least STABLE_AFTER_S before dying is restarted after FIRST_RESTART_DELAY_S; one
# that dies sooner waits twice as long as last time, up to MAX_RESTART_DELAY_S: a server that cannot
# stay up is retried about once a minute, not in a loop.
STABLE_AFTER_S = 60.0
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 60.0


class StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


class Foreground:
    """A foreground command's signals. Armed, the first SIGINT or SIGTERM raises StopRequested in the
    main thread, once; disarmed (while a process is being created) it is only recorded, so that
    the stop knows every process it has to end. SIGHUPs are counted in `hangups`, never lost. `stop`
    ends what the command started (the command sets it as soon as it has created that)."""

    def __init__(self):
        self.armed = self.stopping = False
        self.received: list[str] = []
        self.hangups = 0
        self.stop: Callable[[], object] | None = None
        signal.signal(signal.SIGTERM, self._stop_signal)
        signal.signal(signal.SIGINT, self._stop_signal)
        signal.signal(signal.SIGHUP, self._hangup)

    def _hangup(self, signum, frame) -> None:
        self.hangups += 1  # a plain counter: nothing a signal handler can deadlock on

    def _stop_signal(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum).name)
        if self.armed:
            self.arm()

    def arm(self) -> None:
        """From now on (and at once, for one recorded before) a stop signal raises StopRequested, once."""
        self.armed = True
        if self.received and not self.stopping:
            self.stopping, self.armed = True, False
            raise StopRequested(self.received[0])


def run_in_foreground(command: Callable[[Foreground], int]) -> int:
    """Run `command` to its exit code, or until SIGINT/SIGTERM drains and stops tritonserver (exit 0); a
    ServerError is one line "error: ..." and exit 1. `foreground.stop` runs at the end with later signals
    ignored (its grace periods bound it)."""
    foreground = Foreground()
    try:
        foreground.arm()
        return command(foreground)
    except StopRequested as stop:
        print(f"{stop}: draining and stopping tritonserver", flush=True)
        return 0
    except ServerError as exc:
        return report(exc)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        if foreground.stop is not None:
            began = time.monotonic()
            foreground.stop()
            if foreground.stopping:
                print(f"tritonserver stopped in {time.monotonic() - began:.1f} s", flush=True)


def describe_exit(code: int | None) -> str:
    """'exited with code 1', 'was killed by SIGKILL' (a negative Popen return code, or 128 + the signal
    from the entrypoint's shell)."""
    signum = None if code is None or 0 <= code <= 128 else -code if code < 0 else code - 128
    if signum is None:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(signum).name}"
    except ValueError:
        return f"was killed by signal {signum}"


def restart_delay_s(previous_s: float, lived_s: float) -> float:
    """The delay before starting again a server that died after `lived_s` seconds up (`previous_s`: the
    delay before its last start, 0 if none)."""
    crashed_again = previous_s > 0 and lived_s < STABLE_AFTER_S
    return min(2 * previous_s, MAX_RESTART_DELAY_S) if crashed_again else FIRST_RESTART_DELAY_S


@dataclasses.dataclass
class Supervisor:
    """Watches `server` (under the entrypoint script, which kills a hung server or one whose Python stub
    died): one that exits is reported and, with `restart`, started again on the same ports after the
    backoff delay (its log kept as <log>.<n>); SIGHUP drains it and starts it again at once, reading the
    repository afresh. `server` is replaced on every restart."""

    server: TritonServer
    foreground: Foreground
    restart: bool
    ready_timeout_s: float
    restarts: int = 0
    delay_s: float = 0.0  # the last restart delay
    next_restart_at: float | None = None  # set once the dead server is reported

    def launch(self) -> None:
        self.foreground.armed = False
        try:
            self.server.start()
        finally:
            self.foreground.arm()

    def run(self, poll_s: float = 0.5) -> int:
        """Until the command ends: its exit code without `restart` (a stop signal is raised out of here)."""
        hangups_seen = 0
        while True:
            time.sleep(poll_s)
            if self.foreground.hangups != hangups_seen:
                hangups_seen = self.foreground.hangups
                self._drain_and_restart()
            elif not self.server.is_alive():
                if self.next_restart_at is None:
                    self._report_exit()
                if not self.restart:
                    return self.server.exit_code() or 1
                if time.monotonic() >= self.next_restart_at and (ready_s := self._relaunch()) is not None:
                    print(f"tritonserver restarted (pid {self.server.tritonserver_pid()}, restart {self.restarts}), "
                          f"ready in {ready_s:.1f} s on {self.server.grpc_url}", flush=True)

    def _report_exit(self) -> None:
        server, lived_s = self.server, time.monotonic() - self.server.started_at
        if self.restart:
            self.delay_s = restart_delay_s(self.delay_s, lived_s)
        self.next_restart_at = time.monotonic() + self.delay_s
        delay = f"; restart in {self.delay_s:.1f} s on the same ports" if self.restart else ""
        print(f"tritonserver (pid {server.tritonserver_pid()}) {describe_exit(server.exit_code())} after "
              f"{lived_s:.0f} s{delay}. Log tail ({server.log_path}):\n{log_tail(server.log_path, lines=15)}",
              file=sys.stderr, flush=True)

    def _drain_and_restart(self) -> None:
        """SIGTERM (its streams resume elsewhere), then started again on the same ports; one that does
        not come back is reported and restarted (or not) as a server that died."""
        began, pid = time.monotonic(), self.server.tritonserver_pid()
        print(f"SIGHUP: draining tritonserver (pid {pid}) to start it again", flush=True)
        self.server.stop()  # SIGTERM, which the entrypoint passes on to tritonserver
        drained = describe_exit(self.server.exit_code())
        if (ready_s := self._relaunch()) is not None:
            print(f"tritonserver (pid {pid}) drained ({drained}) and restarted in {time.monotonic() - began:.1f} s "
                  f"(ready in {ready_s:.1f} s, pid {self.server.tritonserver_pid()}, restart {self.restarts})",
                  flush=True)

    def _relaunch(self) -> float | None:
        """The server stopped (its stubs and shared memory gone), its log kept as <log>.<n>, a new one on
        the same ports started and ready: the seconds that took; None when it failed (said, and the
        server then handled as one that died)."""
        old = self.server
        old.stop()
        self.restarts += 1
        if old.log_path is not None and old.log_path.exists():
            old.log_path.rename(old.log_path.with_name(f"{old.log_path.name}.{self.restarts}"))
        self.server, self.next_restart_at = dataclasses.replace(old), None
        self.launch()
        try:
            return self.server.wait_ready(self.ready_timeout_s)
        except ServerError as error:
            self.server.stop()  # one still loading would otherwise look alive
            print(f"error: tritonserver did not come back: {error}", file=sys.stderr, flush=True)
            return None


@contextlib.contextmanager
def running_server(model_repository: Path | str, *, ready_timeout_s: float = 60.0, attempts: int = 3,
                   **kwargs) -> Iterator[TritonServer]:
    """A ready TritonServer (keyword arguments go to it), stopped on exit. A port picked free can be
    taken before the server binds it, and tritonserver 2.51 now and then aborts while its backends
    initialise (docs/design.md §7): then it starts again (new ports where they were picked), up to
    `attempts` times, saying so on stderr. Any other failure raises ServerError with the log tail."""
    ports_fixed = any(kwargs.get(name) for name in ("http_port", "grpc_port", "metrics_port"))
    for attempt in range(1, attempts + 1):
        server = TritonServer(model_repository, **kwargs)
        try:
            server.start()
            server.wait_ready(ready_timeout_s)
            break
        except BaseException as error:
            server.stop()
            crashed = describe_exit(server.exit_code()).startswith("was killed")
            if not isinstance(error, ServerError) or attempt == attempts or not (
                    crashed or not ports_fixed and server.port_taken()):
                raise
            print(f"tritonserver did not start (attempt {attempt} of {attempts}), starting it again: "
                  f"{str(error).splitlines()[0]}", file=sys.stderr, flush=True)
    try:
        yield server
    finally:
        server.stop()
