"""`code2wav-server serve-replicas`: N tritonserver replicas behind nginx, with stream affinity.

A stream's decoder state lives in one replica, so every request of a stream must reach that replica.
Clients send a per-stream key, the gRPC metadata `code2wav-stream`, on every request; nginx hashes it
consistently over the replicas and routes around a replica that died (see `server/nginx.py` and
`docker/nginx/code2wav-proxy.conf.tmpl` for the policy). The streams of a dead replica are lost: their
next requests reach another replica, which does not know them and refuses them until they START again.

Ports (defaults): clients connect to the proxy, gRPC on 8001 and HTTP on 8000, as they would to
`code2wav-server serve`. Replica i listens on loopback only, HTTP on 8100+10i, gRPC on 8101+10i and
metrics on 8102+10i (`--replica-base-port 0`: free ports); metrics are per replica, scrape each one.
Files go to `<build-dir>/replicas/`: replica-<i>.log, and nginx/ (nginx.conf, error.log, access.log
with one line per request naming its stream key and replica).

Without --model-repository the repository is prepared once as for `serve` and every replica serves
it. Ctrl-C or SIGTERM stops the proxy and every replica once and exits 0, leaving no process, port
or shared-memory region. A replica that exits is reported; with --restart it is started again on the
same ports, and nginx gives it its streams back within the fail timeout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, ContextManager

from .nginx import (
    DEFAULT_FAIL_TIMEOUT_S,
    DEFAULT_MAX_FAILS,
    STREAM_KEY_HEADER,
    NginxProxy,
    compose_config,
    find_nginx,
)
from .processes import StopsOnExit, http_ready
from .serve import (
    Foreground,
    RestartBackoff,
    _StopSignals,
    add_repository_arguments,
    describe_exit,
    keep_log,
    prepare_repository,
    run_in_foreground,
)
from .triton import LOCALHOST, ServerError, TritonServer, log_tail, port_is_free

DEFAULT_REPLICA_BASE_PORT = 8100
# Replica i's ports: base + 10 i + (0: HTTP, 1: gRPC, 2: metrics), the layout of `serve` shifted.
REPLICA_PORT_STRIDE = 10


@dataclasses.dataclass
class Replica:
    """One tritonserver of the set. `server` is replaced by a new TritonServer on every restart,
    on the same ports."""

    index: int
    server: TritonServer
    restarts: int = 0
    exit_reported: bool = False
    started_at: float = 0.0
    backoff: RestartBackoff = dataclasses.field(default_factory=RestartBackoff)
    next_restart_at: float = 0.0
    # Health checks in a row that got no answer in time (a hung server).
    unanswered_checks: int = 0

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

    def kill(self, signum: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        """Send `signum` to tritonserver alone, as a crash would end it, and wait until it exits; its
        Python stubs then exit by themselves (`ReplicaSet.restart` and `stop` clean up after them).
        Returns the exit code."""
        if not self.is_alive():
            raise ServerError(f"replica {self.index} is not running")
        self.server.process.send_signal(signum)
        return self.server.process.wait(timeout_s)


class ReplicaSet(StopsOnExit):
    """N tritonserver replicas of one model repository on loopback, behind one nginx proxy.

        with ReplicaSet(repository, replicas=3, run_dir=tmp, grpc_port=0, http_port=0,
                        replica_base_port=None) as replica_set:
            replica_set.proxy_grpc_url          # where clients connect
            replica_set.replicas[1].kill()      # a crash
            replica_set.restart(1)              # back on the same ports

    Replica i uses `replica_base_port + 10 i + (0, 1, 2)` for HTTP, gRPC and metrics, or free ports
    when `replica_base_port` is None. `launch_guard()` is entered around each process launch (the
    foreground command holds its stop signals there, so that stop() always knows every process).
    `proxy_options` go to the proxy's `NginxProxy`: `grpc_port` / `http_port` (0: free ports), `host`
    (the address it binds; replicas always listen on 127.0.0.1), `max_fails`, `fail_timeout_s`, `binary`.
    """

    def __init__(
        self,
        model_repository: Path | str,
        replicas: int = 2,
        *,
        run_dir: Path | str,
        replica_base_port: int | None = DEFAULT_REPLICA_BASE_PORT,
        log_verbose: int = 0,
        launch_guard: Callable[[], ContextManager] = contextlib.nullcontext,
        **proxy_options,
    ):
        if replicas < 1:
            raise ServerError(f"--replicas must be at least 1, got {replicas}")
        self.model_repository = Path(model_repository)
        self.count = replicas
        self.run_dir = Path(run_dir).resolve()
        self.replica_base_port = replica_base_port or None
        self.log_verbose = log_verbose
        self.launch_guard = launch_guard
        self.replicas: list[Replica] = []
        # Its replicas' addresses are known once they have started.
        self.proxy = NginxProxy(self.run_dir / "nginx", **proxy_options)
        self.ready_after_s: float | None = None

    # Addresses: the proxy's, where clients connect.
    proxy_grpc_url = property(lambda self: self.proxy.grpc_url)
    proxy_http_url = property(lambda self: self.proxy.http_url)

    def replica_ports(self, index: int) -> tuple[int | None, int | None, int | None]:
        """(HTTP, gRPC, metrics) of replica `index`; None where a free port is picked at start."""
        if self.replica_base_port is None:
            return None, None, None
        base = self.replica_base_port + REPLICA_PORT_STRIDE * index
        return base, base + 1, base + 2

    def _check_fixed_ports(self) -> None:
        wanted = {}
        if self.proxy.grpc_port:
            wanted[self.proxy.grpc_port] = "the proxy's gRPC port (--grpc-port)"
        if self.proxy.http_port:
            wanted[self.proxy.http_port] = "the proxy's HTTP port (--http-port)"
        for index in range(self.count):
            for port, kind in zip(self.replica_ports(index), ("HTTP", "gRPC", "metrics")):
                if port is not None:
                    wanted.setdefault(port, f"replica {index}'s {kind} port (--replica-base-port)")
        taken = [f"{port} ({what})" for port, what in wanted.items()
                 if not port_is_free(port, self.proxy.host if "proxy" in what else LOCALHOST)]
        if taken:
            raise ServerError(
                "ports already in use: " + "; ".join(taken)
                + ". Is another server running (make serve)? Choose other ports."
            )

    def _new_server(self, index: int, ports: tuple[int | None, int | None, int | None]) -> TritonServer:
        http_port, grpc_port, metrics_port = ports
        return TritonServer(
            self.model_repository,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            host=LOCALHOST,
            log_path=self.run_dir / f"replica-{index}.log",
            log_verbose=self.log_verbose,
        )

    def _launch(self, replica: Replica) -> None:
        with self.launch_guard():
            replica.started_at = time.monotonic()
            replica.server.start()

    # Lifecycle -------------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 120.0) -> float:
        """Start every replica and the proxy, wait until each replica is ready and the proxy answers
        /v2/health/ready; returns the seconds that took. Raises ServerError (nothing is stopped:
        call stop(), or use the set as a context manager, which does)."""
        if self.replicas:
            raise ServerError("this ReplicaSet was already started")
        began = time.monotonic()
        find_nginx(self.proxy.binary)  # before any replica starts: a missing nginx fails at once
        self._check_fixed_ports()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for index in range(self.count):
            replica = Replica(index, self._new_server(index, self.replica_ports(index)))
            self.replicas.append(replica)
            self._launch(replica)
        self.proxy.grpc_servers = [replica.grpc_url for replica in self.replicas]
        self.proxy.http_servers = [replica.http_url for replica in self.replicas]
        with self.launch_guard():
            self.proxy.start()
        deadline = time.monotonic() + ready_timeout_s
        for replica in self.replicas:
            try:
                replica.server.wait_ready(max(1.0, deadline - time.monotonic()))
            except ServerError as error:
                raise ServerError(f"replica {replica.index}: {error}") from error
        self.proxy.wait_ready()
        self.wait_proxy_ready(max(1.0, deadline - time.monotonic()))
        self.ready_after_s = time.monotonic() - began
        return self.ready_after_s

    def wait_proxy_ready(self, timeout_s: float = 10.0) -> None:
        """Poll /v2/health/ready through the proxy until a replica answers it with 200."""
        url = f"http://{self.proxy_http_url}/v2/health/ready"
        self.proxy.wait_until(lambda: http_ready(url, 2.0), timeout_s, what=f"the proxy at {url}")

    def kill(self, index: int, signum: int = signal.SIGKILL) -> int:
        """Kill replica `index`'s tritonserver as a crash would; see Replica.kill."""
        return self.replicas[index].kill(signum)

    def take_out(self, index: int) -> None:
        """Route no request to replica `index` (its keys go to the next replica) until put_back()."""
        self.proxy.take_out(index)

    def put_back(self, index: int) -> None:
        self.proxy.put_back(index)

    def taken_out(self, index: int) -> bool:
        return index in self.proxy.down

    def restart(self, index: int, ready_timeout_s: float = 120.0) -> float:
        """Start replica `index` again on the same ports and wait until it is ready; returns the
        seconds that took. A running replica is stopped first. Its previous log is kept as
        replica-<i>.log.<n>. nginx gives the replica its keys back once the fail timeout of its last
        failed attempt has passed."""
        replica = self.replicas[index]
        old = replica.server
        old.stop()  # a dead one: waits for its stubs, removes its shared memory
        replica.restarts += 1
        keep_log(old, replica.restarts)
        replica.server = self._new_server(index, (old.http_port, old.grpc_port, old.metrics_port))
        replica.exit_reported = False
        self._launch(replica)
        try:
            return replica.server.wait_ready(ready_timeout_s)
        except ServerError as error:
            replica.server.stop()  # one still loading would otherwise look alive
            raise ServerError(f"replica {index} did not come back: {error}") from error

    def stop(self) -> None:
        """Stop the proxy, then every replica at once (each waits for its live sequences up to its
        exit timeout); idempotent."""
        self.proxy.stop()
        if not self.replicas:
            return
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
            for future in [pool.submit(replica.server.stop) for replica in self.replicas]:
                future.result()

    def start_ready(self) -> float:
        """`start()`, which waits for readiness itself (the context manager's entry)."""
        return self.start()

    # Reporting -------------------------------------------------------------------------------
    def table(self) -> str:
        """Where everything listens, one line per replica."""
        rows = [("replica", "gRPC", "HTTP", "metrics", "pid", "log")]
        for replica in self.replicas:
            rows.append((str(replica.index), replica.grpc_url, replica.http_url,
                         replica.metrics_url or "-", str(replica.pid), str(replica.log_path)))
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
        return "\n".join(
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
            for row in rows
        )


@contextlib.contextmanager
def _signals_held(stop_signals: _StopSignals):
    """Record, without acting on, SIGINT/SIGTERM while a process is being created; act on exit."""
    stop_signals.disarm()
    try:
        yield
    finally:
        stop_signals.arm()


@dataclasses.dataclass(frozen=True)
class HealthCheck:
    """How the supervisor tells a hung replica: every poll it asks each running replica's
    /v2/health/ready. A replica that answers "not ready" (it is draining) is taken out of the proxy at
    once; one that does not answer within `timeout_s`, `unanswered` times in a row (it hangs), is taken
    out too, and with restarts it is killed and started again. A replica taken out goes back once it
    answers ready again. `timeout_s` 0: no checks."""

    timeout_s: float = 2.0
    unanswered: int = 3

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


def _check_health(replica_set: ReplicaSet, health: HealthCheck, restart: bool) -> None:
    running = [replica for replica in replica_set.replicas if replica.is_alive()]
    if not health.enabled or not running:
        return
    with concurrent.futures.ThreadPoolExecutor(len(running)) as pool:
        answers = list(pool.map(lambda r: http_ready(f"http://{r.http_url}/v2/health/ready", health.timeout_s), running))
    for replica, problem in zip(running, answers):
        taken_out = replica_set.taken_out(replica.index)
        if problem is None:
            replica.unanswered_checks = 0
            if taken_out:
                replica_set.put_back(replica.index)
                print(f"replica {replica.index} answers ready again: back in the proxy", flush=True)
            continue
        answered = problem.startswith("HTTP ")
        replica.unanswered_checks = 0 if answered else replica.unanswered_checks + 1
        if not answered and replica.unanswered_checks < health.unanswered:
            continue
        if not taken_out:
            replica_set.take_out(replica.index)
            why = ("is not ready (" + problem + ")" if answered else
                   f"has not answered its health check for {health.unanswered} checks of {health.timeout_s:g} s")
            print(f"replica {replica.index} (pid {replica.pid}) {why}: taken out of the proxy; its streams "
                  "resume on the other replicas", file=sys.stderr, flush=True)
        if restart and not answered:
            replica.kill()  # hung: the restart below brings it back
            replica.unanswered_checks = 0


def _rolling_restart(replica_set: ReplicaSet, ready_timeout_s: float) -> None:
    """Each replica in turn: out of the proxy, drained (SIGTERM: its streams resume on the others),
    started again on the same ports, back in the proxy; then the next one."""
    for replica in replica_set.replicas:
        replica_set.take_out(replica.index)
        began = time.monotonic()
        if replica.is_alive():
            replica.kill(signal.SIGTERM, timeout_s=replica.server.stop_grace_s)
        drained = describe_exit(replica.exit_code())
        ready_s = replica_set.restart(replica.index, ready_timeout_s)
        replica.exit_reported = False
        replica_set.put_back(replica.index)
        print(f"replica {replica.index} drained ({drained}) and restarted in {time.monotonic() - began:.1f} s "
              f"(ready in {ready_s:.1f} s, pid {replica.pid}): back in the proxy", flush=True)


def _supervise(replica_set: ReplicaSet, restart: bool, ready_timeout_s: float, poll_s: float = 0.5,
               health: HealthCheck = HealthCheck(), rolling: threading.Event | None = None) -> int:
    """Watch the proxy and the replicas until a stop signal (raised out of here) or until serving
    is over: nginx exited, or every replica is gone and none is restarted. Returns the exit code.
    `rolling` set (SIGHUP): a rolling restart of every replica."""
    while True:
        time.sleep(poll_s)
        proxy = replica_set.proxy
        if not proxy.is_alive():
            print(f"nginx exited by itself with code {proxy.exit_code()} (error log {proxy.error_log}):\n"
                  f"{log_tail(proxy.error_log)}", file=sys.stderr, flush=True)
            return 1
        if rolling is not None and rolling.is_set():
            rolling.clear()
            print("SIGHUP: rolling restart of the replicas, one at a time", flush=True)
            _rolling_restart(replica_set, ready_timeout_s)
            continue
        _check_health(replica_set, health, restart)
        for replica in replica_set.replicas:
            if replica.is_alive():
                continue
            now = time.monotonic()
            if not replica.exit_reported:
                replica.exit_reported = True
                lived_s = now - replica.started_at
                delay = f"; restart in {replica.backoff.after_exit(lived_s):.1f} s" if restart else ""
                print(
                    f"replica {replica.index} (pid {replica.pid}) {describe_exit(replica.exit_code())} after "
                    f"{lived_s:.0f} s; its streams resume on the other replicas{delay}. Log tail "
                    f"({replica.log_path}):\n{log_tail(replica.log_path, lines=15)}",
                    file=sys.stderr, flush=True,
                )
                replica.next_restart_at = now + replica.backoff.delay_s
            if restart and now >= replica.next_restart_at:
                try:
                    ready_s = replica_set.restart(replica.index, ready_timeout_s)
                except ServerError as error:
                    print(f"error: {error}", file=sys.stderr, flush=True)
                    replica.exit_reported = False  # report, and schedule the next attempt
                    continue
                print(f"replica {replica.index} restarted (pid {replica.pid}, restart {replica.restarts}), "
                      f"ready in {ready_s:.1f} s on {replica.grpc_url}", flush=True)
                if replica_set.taken_out(replica.index):
                    replica_set.put_back(replica.index)
                    print(f"replica {replica.index}: back in the proxy", flush=True)
        if not restart and not any(replica.is_alive() for replica in replica_set.replicas):
            print("error: every replica has exited; stopping the proxy", file=sys.stderr, flush=True)
            return 1


def run(args: argparse.Namespace) -> int:
    if args.print_compose_config:
        print(compose_config(args.replicas), end="")
        return 0
    return run_in_foreground(lambda foreground: _serve_replicas(args, foreground), "stopping nginx and the replicas",
                             "nginx and the replicas")


def _serve_replicas(args: argparse.Namespace, foreground: Foreground) -> int:
    repository = prepare_repository(args)
    # The command's flags of these names are ReplicaSet's parameters.
    settings = {name: getattr(args, name) for name in ("grpc_port", "http_port", "host", "replica_base_port",
                                                       "max_fails", "fail_timeout_s", "log_verbose")}
    replica_set = ReplicaSet(
        repository, args.replicas, **settings, binary=args.nginx,
        run_dir=args.run_dir if args.run_dir is not None else Path(args.build_dir) / "replicas",
        launch_guard=lambda: _signals_held(foreground.signals),
    )
    foreground.stop = replica_set.stop
    print(f"starting {args.replicas} tritonserver replicas and nginx, serving {repository}", flush=True)
    ready_after_s = replica_set.start(args.ready_timeout)
    proxy = replica_set.proxy
    print(
        f"ready in {ready_after_s:.1f} s: nginx {proxy.install.version_text} (pid {proxy.pid}) in front of "
        f"{args.replicas} replicas, stream affinity on the gRPC metadata '{STREAM_KEY_HEADER}'\n"
        f"  gRPC     {replica_set.proxy_grpc_url}\n"
        f"  HTTP     http://{replica_set.proxy_http_url}\n"
        f"  nginx    {proxy.conf_path} (access log {proxy.access_log})\n"
        f"{replica_set.table()}\n"
        f"Replicas that exit are {'restarted' if args.restart else 'reported, not restarted (--restart)'}. "
        "Ctrl-C or SIGTERM stops everything.",
        flush=True,
    )
    rolling = threading.Event()
    signal.signal(signal.SIGHUP, lambda signum, frame: rolling.set())
    return _supervise(replica_set, args.restart, args.ready_timeout,
                      health=HealthCheck(args.health_timeout_s, args.health_checks), rolling=rolling)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="tritonserver replicas (default %(default)s)")
    add_repository_arguments(parser, "every replica serves")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="replica logs and nginx's files (default: <build-dir>/replicas)")
    parser.add_argument("--host", default=LOCALHOST, help="address the proxy binds (default %(default)s); "
                        "replicas always listen on 127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=8001, help="the proxy's gRPC port (default %(default)s)")
    parser.add_argument("--http-port", type=int, default=8000, help="the proxy's HTTP port (default %(default)s)")
    parser.add_argument("--replica-base-port", type=int, default=DEFAULT_REPLICA_BASE_PORT,
                        help="replica i listens on BASE+10i (HTTP), +1 (gRPC), +2 (metrics); 0: free ports "
                        "(default %(default)s)")
    parser.add_argument("--restart", action="store_true",
                        help="start a replica that exits again, on the same ports (backing off if it keeps exiting)")
    parser.add_argument("--max-fails", type=int, default=DEFAULT_MAX_FAILS,
                        help="failed attempts within the fail timeout that take a replica out (default %(default)s)")
    parser.add_argument("--fail-timeout-s", type=int, default=DEFAULT_FAIL_TIMEOUT_S,
                        help="seconds a failed replica takes no requests before nginx probes it (default %(default)s)")
    parser.add_argument("--health-timeout-s", type=float, default=HealthCheck.timeout_s,
                        help="a replica that does not answer /v2/health/ready within this, --health-checks times in a "
                        "row, is taken out of the proxy (and restarted with --restart); one that answers not ready "
                        "(draining) at once; 0: no checks (default %(default)s)")
    parser.add_argument("--health-checks", type=int, default=HealthCheck.unanswered,
                        help="unanswered health checks in a row that make a replica hung (default %(default)s)")
    parser.add_argument("--nginx", type=Path, default=None, help="nginx binary (default: nginx on PATH or in /usr/sbin)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbose log level")
    parser.add_argument("--ready-timeout", type=float, default=120.0,
                        help="seconds to wait for the replicas to be ready")
    parser.add_argument("--print-compose-config", action="store_true",
                        help="print the nginx config of the compose `scale` profile for --replicas services "
                        "(docker/nginx/compose.conf) and exit")
