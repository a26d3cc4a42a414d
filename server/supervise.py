"""One supervisor for `code2wav-server serve` (one tritonserver) and `serve-replicas` (N behind nginx).

The command runs in the foreground (`run_in_foreground`): the first SIGINT or SIGTERM stops it once
and cleanly (`StopSignals`; a second signal, or one that reaches the process group twice, cannot
interrupt that stop), and a signal that lands while a process is being created waits until the
process exists (`signals_held`), so the stop always knows every process it has to end.

`supervise` then polls the servers (`Replica`) until the command ends:

- a server that exits is reported with its log tail. With restarts it is started again on the same
  ports after `RestartBackoff`'s delay, its log kept as <log>.<n>; its streams are lost there and
  resumable clients resume them (docs/design.md §2.4). Without, the command ends once every server
  has exited (with the server's exit code for a single server);
- stub probes (every STUB_PROBE_EVERY_S, serve and serve-replicas): a server whose code2wav or decoder
  stub died (`processes.dead_stub`: ready, yet every request fails) is killed, so that the restart
  brings it back whole (without restarts the command ends with it);
- health checks (`HealthCheck`, serve-replicas): a server that answers "not ready" (draining) leaves
  the proxy at once; one that does not answer `unanswered` times in a row (hung) leaves it too and,
  with restarts, is killed and started again; it goes back once it answers ready;
- SIGHUP: each server in turn leaves the proxy (if any), is drained (SIGTERM: it refuses new streams,
  live ones get UNAVAILABLE and resume elsewhere) and started again at once, reading the repository
  afresh, and comes back: the operator's restart;
- nginx exiting by itself ends the command.

Inside a container the same first job, restarting a tritonserver that died, is docker/triton-watchdog.sh's
(the orchestrator restarts the container around it): docs/design.md §5.2.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import signal
import subprocess
import sys
import time
from typing import Callable, ContextManager

from .processes import ServerError, dead_stub, http_ready, log_tail
from .triton import TritonServer

# A server that lived at least this long before dying is restarted after FIRST_RESTART_DELAY_S; one
# that dies sooner than that after its previous restart waits twice as long as last time, up to
# MAX_RESTART_DELAY_S: a server that cannot stay up is retried about once a minute, not in a loop.
STABLE_AFTER_S = 60.0
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 60.0
# How often each running server is asked whether its Python stubs are alive, and how long the answer
# may take (the Python backend takes seconds to call a stub dead).
STUB_PROBE_EVERY_S = 5.0
STUB_PROBE_TIMEOUT_S = 10.0


class StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


class StopSignals:
    """SIGINT/SIGTERM handler. While disarmed (a process being created) a signal is only recorded;
    armed, the first signal interrupts the main thread with StopRequested, once: every later one is
    only recorded. SIGHUP is counted in `hangups` from the start (the supervisor acts on it once its
    servers serve), so that one arriving while they start neither kills the command nor is lost."""

    def __init__(self):
        self.armed = False
        self.stopping = False
        self.received: list[str] = []
        self.hangups = 0
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGHUP, self._hangup)

    def _hangup(self, signum, frame) -> None:
        self.hangups += 1  # a plain counter: nothing a signal handler can deadlock on

    def __call__(self, signum, frame):
        self.received.append(signal.Signals(signum).name)
        if self.armed:
            self._stop()

    def disarm(self) -> None:
        self.armed = False

    def arm(self) -> None:
        self.armed = True
        if self.received:
            self._stop()

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.armed = False
            raise StopRequested(self.received[0])


@contextlib.contextmanager
def signals_held(stop_signals: StopSignals):
    """Record, without acting on, SIGINT/SIGTERM while a process is being created; act on exit."""
    stop_signals.disarm()
    try:
        yield
    finally:
        stop_signals.arm()


@dataclasses.dataclass
class Foreground:
    """A foreground command's stop: `signals` request it, `stop` ends what the command started (the
    command sets it as soon as it has created that; None before)."""

    signals: StopSignals
    stop: Callable[[], object] | None = None

    def launch_guard(self) -> ContextManager:
        return signals_held(self.signals)


def run_in_foreground(command: Callable[[Foreground], int], stopping: str, what: str) -> int:
    """Run `command` to its exit code, or until SIGINT/SIGTERM stops it ("<signal>: <stopping>", exit
    0); a ServerError is one line "error: ..." and exit 1. Either way `stop` runs at the end, with
    later signals ignored (it is bounded by its grace periods), and after a stop signal the command
    says "<what> stopped in N s"."""
    foreground = Foreground(StopSignals())
    try:
        foreground.signals.arm()
        return command(foreground)
    except StopRequested as stop:
        print(f"{stop}: {stopping}", flush=True)
        return 0
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        if foreground.stop is not None:
            began = time.monotonic()
            foreground.stop()
            if foreground.signals.stopping:
                print(f"{what} stopped in {time.monotonic() - began:.1f} s", flush=True)


class RestartBackoff:
    """When to start a server again after it died: FIRST_RESTART_DELAY_S after a server that had been
    up for STABLE_AFTER_S, else twice the previous delay, up to MAX_RESTART_DELAY_S."""

    def __init__(self, first_s: float = FIRST_RESTART_DELAY_S, max_s: float = MAX_RESTART_DELAY_S,
                 stable_after_s: float = STABLE_AFTER_S):
        self.first_s, self.max_s, self.stable_after_s = first_s, max_s, stable_after_s
        self.restarts = 0
        self.delay_s = 0.0

    def after_exit(self, lived_s: float) -> float:
        """A server died after `lived_s` seconds up: the delay before its restart (counted)."""
        crashed_again = self.restarts > 0 and lived_s < self.stable_after_s
        self.delay_s = min(max(2 * self.delay_s, self.first_s), self.max_s) if crashed_again else self.first_s
        self.restarts += 1
        return self.delay_s


def describe_exit(code: int | None) -> str:
    """'exited with code 1', 'was killed by SIGKILL' (a negative Popen return code)."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclasses.dataclass
class Replica:
    """One supervised tritonserver. `new_server(ports)` makes its successor on the same (HTTP, gRPC,
    metrics) ports; `server` is replaced on every restart. `label` names it in messages."""

    index: int
    server: TritonServer
    new_server: Callable[[tuple], TritonServer]
    label: str
    restarts: int = 0
    exit_reported: bool = False
    started_at: float = 0.0
    backoff: RestartBackoff = dataclasses.field(default_factory=RestartBackoff)
    next_restart_at: float = 0.0
    unanswered_checks: int = 0  # health checks in a row that got no answer in time (a hung server)

    # Read from the current server, which each restart replaces.
    pid = property(lambda self: self.server.pid)
    grpc_url = property(lambda self: self.server.grpc_url)
    http_url = property(lambda self: self.server.http_url)
    metrics_url = property(lambda self: self.server.metrics_url)
    log_path = property(lambda self: self.server.log_path)

    def is_alive(self) -> bool:
        return self.server.is_alive()

    def exit_code(self) -> int | None:
        return self.server.exit_code()

    def launch(self, guard: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        with guard():
            self.started_at = time.monotonic()
            self.server.start()

    def kill(self, signum: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        """Send `signum` to tritonserver alone, as a crash would end it, and wait until it exits; its
        Python stubs then exit by themselves (`relaunch` and `stop` clean up after them). Returns the
        exit code."""
        if not self.is_alive():
            raise ServerError(f"{self.label} is not running")
        self.server.process.send_signal(signum)
        return self.server.process.wait(timeout_s)

    def relaunch(self, ready_timeout_s: float, guard: Callable[[], ContextManager] = contextlib.nullcontext) -> float:
        """Start the server again on the same ports and wait until it is ready; returns the seconds
        that took. A running server is stopped first; the previous log is kept as <log>.<n>."""
        old = self.server
        old.stop()  # a dead one: waits for its stubs, removes its shared memory
        self.restarts += 1
        if old.log_path is not None and old.log_path.exists():
            old.log_path.rename(old.log_path.with_name(f"{old.log_path.name}.{self.restarts}"))
        self.server = self.new_server((old.http_port, old.grpc_port, old.metrics_port))
        self.exit_reported = False
        self.launch(guard)
        try:
            return self.server.wait_ready(ready_timeout_s)
        except ServerError as error:
            self.server.stop()  # one still loading would otherwise look alive
            raise ServerError(f"{self.label} did not come back: {error}") from error


@dataclasses.dataclass(frozen=True)
class HealthCheck:
    """Every poll, each running server's /v2/health/ready is asked, within `timeout_s`; `unanswered`
    misses in a row make a server hung. `timeout_s` 0: no checks."""

    timeout_s: float = 2.0
    unanswered: int = 3

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


class NoProxy:
    """What `supervise` asks of a proxy, for a server that has none."""

    down: set[int] = set()
    balances = False

    def is_alive(self) -> bool:
        return True

    def take_out(self, index: int) -> None:
        pass

    def put_back(self, index: int) -> None:
        pass


def supervise(replicas: list[Replica], foreground: Foreground, *, restart: bool, ready_timeout_s: float,
              proxy=None, health: HealthCheck = HealthCheck(0), poll_s: float = 0.5,
              stub_probe_s: float = STUB_PROBE_EVERY_S) -> int:
    """Watch `replicas` (behind `proxy`, an NginxProxy, if given) until the command ends (module
    docstring); a stop signal is raised out of here, SIGHUPs are `foreground.signals.hangups`.
    `stub_probe_s` 0: no stub probes. Returns the exit code."""
    signals, guard = foreground.signals, foreground.launch_guard
    hangups_seen = 0
    behind = proxy if proxy is not None else NoProxy()
    next_probe_at = time.monotonic() + stub_probe_s
    while True:
        time.sleep(poll_s)
        if not behind.is_alive():
            print(f"nginx exited by itself with code {proxy.exit_code()} (error log {proxy.error_log}):\n"
                  f"{log_tail(proxy.error_log)}", file=sys.stderr, flush=True)
            return 1
        if signals.hangups != hangups_seen:
            hangups_seen = signals.hangups
            print("SIGHUP: rolling restart of the replicas, one at a time" if proxy is not None else
                  f"SIGHUP: draining tritonserver (pid {replicas[0].pid}) to start it again", flush=True)
            for replica in replicas:
                if not _drain_and_restart(replica, behind, ready_timeout_s, guard):
                    break  # that one is restarted as a dead server would be (or the command ends)
            continue
        _check_health(replicas, behind, health, restart)
        if stub_probe_s > 0 and time.monotonic() >= next_probe_at:
            _probe_stubs(replicas, behind)
            next_probe_at = time.monotonic() + stub_probe_s
        for replica in replicas:
            if not replica.is_alive():
                _dead(replica, behind, restart, ready_timeout_s, guard)
        if not restart and not any(replica.is_alive() for replica in replicas):
            if proxy is not None:
                print("error: every replica has exited; stopping the proxy", file=sys.stderr, flush=True)
                return 1
            return replicas[0].exit_code() or 1


def _dead(replica: Replica, proxy, restart: bool, ready_timeout_s: float, guard) -> None:
    now = time.monotonic()
    if not replica.exit_reported:
        replica.exit_reported = True
        lived_s = now - replica.started_at
        where = "; its streams resume on the other replicas" if proxy.balances else ""
        delay = f"; restart in {replica.backoff.after_exit(lived_s):.1f} s on the same ports" if restart else ""
        print(f"{replica.label} (pid {replica.pid}) {describe_exit(replica.exit_code())} after {lived_s:.0f} s"
              f"{where}{delay}. Log tail ({replica.log_path}):\n{log_tail(replica.log_path, lines=15)}",
              file=sys.stderr, flush=True)
        replica.next_restart_at = now + replica.backoff.delay_s
    if restart and now >= replica.next_restart_at:
        try:
            ready_s = replica.relaunch(ready_timeout_s, guard)
        except ServerError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            replica.exit_reported = False  # report, and schedule the next attempt
            return
        print(f"{replica.label} restarted (pid {replica.pid}, restart {replica.restarts}), ready in {ready_s:.1f} s "
              f"on {replica.grpc_url}", flush=True)
        if replica.index in proxy.down:
            proxy.put_back(replica.index)
            print(f"{replica.label}: back in the proxy", flush=True)


def _check_health(replicas: list[Replica], proxy, health: HealthCheck, restart: bool) -> None:
    running = [replica for replica in replicas if replica.is_alive()]
    if not health.enabled or not running:
        return
    with concurrent.futures.ThreadPoolExecutor(len(running)) as pool:
        answers = list(pool.map(lambda r: http_ready(f"http://{r.http_url}/v2/health/ready", health.timeout_s), running))
    for replica, problem in zip(running, answers):
        taken_out = replica.index in proxy.down
        if problem is None:
            replica.unanswered_checks = 0
            if taken_out:
                proxy.put_back(replica.index)
                print(f"{replica.label} answers ready again: back in the proxy", flush=True)
            continue
        answered = problem.startswith("HTTP ")
        replica.unanswered_checks = 0 if answered else replica.unanswered_checks + 1
        if not answered and replica.unanswered_checks < health.unanswered:
            continue
        if not taken_out:
            proxy.take_out(replica.index)
            why = ("is not ready (" + problem + ")" if answered else
                   f"has not answered its health check for {health.unanswered} checks of {health.timeout_s:g} s")
            print(f"{replica.label} (pid {replica.pid}) {why}: taken out of the proxy; its streams "
                  "resume on the other replicas", file=sys.stderr, flush=True)
        if restart and not answered:
            replica.kill()  # hung: the restart brings it back
            replica.unanswered_checks = 0


def _probe_stubs(replicas: list[Replica], proxy) -> None:
    """Kill each running server with a dead Python stub: the next poll finds it exited and
    restarts it (or ends the command) as it would after a crash."""
    running = [replica for replica in replicas if replica.is_alive()]
    if not running:
        return
    with concurrent.futures.ThreadPoolExecutor(len(running)) as pool:
        answers = list(pool.map(lambda r: dead_stub(r.http_url, STUB_PROBE_TIMEOUT_S), running))
    for replica, error in zip(running, answers):
        if error is None or not replica.is_alive():
            continue
        proxy.take_out(replica.index)
        print(f"{replica.label} (pid {replica.pid}) answers ready, but a Python stub is dead ({error.strip()}): "
              "killing it (SIGKILL) so that it starts again whole", file=sys.stderr, flush=True)
        with contextlib.suppress(ServerError, subprocess.TimeoutExpired):
            replica.kill()


def _drain_and_restart(replica: Replica, proxy, ready_timeout_s: float, guard) -> bool:
    """Out of the proxy, drained (SIGTERM: its streams resume elsewhere), started again on the same
    ports, back in the proxy. False when it did not come back: it is then reported and restarted (or
    not) as a server that died."""
    proxy.take_out(replica.index)
    began, pid = time.monotonic(), replica.pid
    if replica.is_alive():
        with contextlib.suppress(subprocess.TimeoutExpired):  # relaunch stops what is left of it
            replica.kill(signal.SIGTERM, timeout_s=replica.server.stop_grace_s)
    drained = describe_exit(replica.exit_code())
    try:
        ready_s = replica.relaunch(ready_timeout_s, guard)
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        replica.exit_reported = False
        return False
    proxy.put_back(replica.index)
    print(f"{replica.label} (pid {pid}) drained ({drained}) and restarted in {time.monotonic() - began:.1f} s "
          f"(ready in {ready_s:.1f} s, pid {replica.pid}, restart {replica.restarts})"
          + (": back in the proxy" if proxy.balances else ""), flush=True)
    return True
