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
import signal
import time
from pathlib import Path
from typing import Callable, ContextManager

from mimi_code2wav.client.protocol import STREAM_KEY_HEADER

from .nginx import (
    DEFAULT_FAIL_TIMEOUT_S,
    DEFAULT_MAX_FAILS,
    NginxProxy,
    compose_config,
    find_nginx,
)
from .processes import ServerError, StopsOnExit, http_ready
from .serve import add_repository_arguments, prepare_repository
from .supervise import Foreground, HealthCheck, Replica, run_in_foreground, supervise
from .triton import DEFAULT_EXIT_TIMEOUT_S, LOCALHOST, TritonServer, port_is_free

DEFAULT_REPLICA_BASE_PORT = 8100
# Replica i's ports: base + 10 i + (0: HTTP, 1: gRPC, 2: metrics), the layout of `serve` shifted.
REPLICA_PORT_STRIDE = 10


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
    `exit_timeout_s` is each replica's --exit-timeout-secs: how long a stopping replica waits for its
    live streams (a drain), as for `serve`.
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
        exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S,
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
        self.exit_timeout_s = exit_timeout_s
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
            exit_timeout_s=self.exit_timeout_s,
        )

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
            replica = Replica(index, self._new_server(index, self.replica_ports(index)),
                              lambda ports, index=index: self._new_server(index, ports), f"replica {index}")
            self.replicas.append(replica)
            replica.launch(self.launch_guard)
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

    def restart(self, index: int, ready_timeout_s: float = 120.0) -> float:
        """Start replica `index` again on the same ports and wait until it is ready (`Replica.relaunch`);
        nginx gives the replica its keys back once the fail timeout of its last failed attempt has passed."""
        return self.replicas[index].relaunch(ready_timeout_s, self.launch_guard)

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
        launch_guard=foreground.launch_guard,
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
    return supervise(replica_set.replicas, foreground, restart=args.restart, ready_timeout_s=args.ready_timeout,
                     proxy=replica_set.proxy, health=HealthCheck(args.health_timeout_s, args.health_checks))


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
