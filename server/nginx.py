"""nginx as the gRPC and HTTP proxy in front of tritonserver replicas, with stream affinity.

A stream's decoder state lives in one replica, so every request of a stream must reach the same
replica. Clients send a per-stream key as the gRPC metadata (HTTP/2 header) `code2wav-stream` on every
request; nginx hashes it consistently over the replicas (`hash ... consistent`), marks a replica that
refuses or drops connections as failed for a while (passive health checks) and sends that replica's
keys to the next one meanwhile. The policy and the reasons for each setting are in the template,
`docker/nginx/code2wav-proxy.conf.tmpl`, rendered here for two targets:

- `NginxProxy.config_text`: the proxy that `code2wav-server serve-replicas` runs on loopback, every
  file (pid, logs, temporary folders) inside its own folder, in the foreground (`daemon off`);
- `compose_config`: `docker/nginx/compose.conf`, the compose `scale` profile's file (a test keeps it fresh).

`NginxProxy` (a `processes.ServerProcess`) runs one nginx in its own process group: it checks the
config with `nginx -t` first, waits until both ports accept connections, and stops only what it started.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import re
import shutil
import signal
import socket
import string
import subprocess
import time
from pathlib import Path
from typing import Collection, Sequence

from .processes import ServerError, ServerProcess, log_tail
from .triton import LOCALHOST, free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = REPO_ROOT / "docker" / "nginx" / "code2wav-proxy.conf.tmpl"
# Where nginx is commonly installed; /usr/sbin is not on a normal user's PATH on Debian.
_SEARCH_DIRS = ("/usr/sbin", "/usr/local/sbin", "/usr/local/nginx/sbin", "/sbin")
# Oldest nginx whose directives the template uses (`keepalive_timeout` in an upstream block).
MIN_VERSION = (1, 15, 3)
# `-e` (the error log before the config is read) appeared in 1.19.5; `http2 on;` replaced
# `listen ... http2` in 1.25.1.
_ERROR_LOG_FLAG_VERSION = (1, 19, 5)
_HTTP2_DIRECTIVE_VERSION = (1, 25, 1)

# Passive health checks (see the template). max_fails > 1 so that one stray failure does not move
# every stream of a healthy replica; a dead replica still costs nothing, since a request that finds
# it refusing connections is retried on the next replica at once.
DEFAULT_MAX_FAILS = 3
# How long a failed replica takes no requests before one probes it, hence also about how long a
# restarted replica waits before its keys come back to it.
DEFAULT_FAIL_TIMEOUT_S = 5

# The compose `scale` profile: replica services triton-replica-0 .. -2, each a name of its own.
COMPOSE_REPLICAS = 3
COMPOSE_REPLICA_SERVICE = "triton-replica-{index}"


class NginxError(ServerError):
    """nginx is missing, too old, rejects its config, or did not start."""


class _ConfigTemplate(string.Template):
    """`{{name}}` placeholders, since nginx itself writes its variables `$name`."""

    delimiter = "{{"
    pattern = r"\{\{(?:(?P<escaped>(?!))|(?P<named>[a-z_]+)\}\}|(?P<braced>(?!))|(?P<invalid>))"


@dataclasses.dataclass(frozen=True)
class NginxInstall:
    binary: Path
    version: tuple[int, int, int]

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


@dataclasses.dataclass(frozen=True)
class ProxiedRequest:
    """One line of the proxy's access log (the template's `code2wav_proxy` format)."""

    time_s: float  # wall-clock time (time.time()) nginx logged it
    stream_key: str
    tried: tuple[str, ...]  # replicas (host:port) tried, in order; the last one answered

    @property
    def replica(self) -> str:
        return self.tried[-1]


_ACCESS_LINE = re.compile(r'^\S+ (?P<msec>[0-9.]+) stream="(?P<key>[^"]*)" upstream="(?P<upstream>[^"]*)" ')


def read_access_log(path: Path) -> list[ProxiedRequest]:
    """The requests with a stream key in an access log of the `code2wav_proxy` format."""
    requests = []
    for line in Path(path).read_text().splitlines():
        match = _ACCESS_LINE.match(line)
        if match and match["key"] and match["key"] != "-":
            requests.append(ProxiedRequest(float(match["msec"]), match["key"], tuple(match["upstream"].split(", "))))
    return requests


def replicas_by_stream(requests: Sequence[ProxiedRequest]) -> dict[str, set[str]]:
    """Stream key -> the replicas that answered its requests."""
    served: dict[str, set[str]] = {}
    for request in requests:
        served.setdefault(request.stream_key, set()).add(request.replica)
    return served


def find_nginx(binary: Path | str | None = None) -> NginxInstall:
    """The nginx to run: `binary`, else `nginx` on PATH or in the usual sbin folders. Raises
    NginxError saying how to install it when there is none, or when it is too old or lacks the gRPC
    proxy or the hash balancer."""
    if binary is not None:
        found = shutil.which(str(binary))
        if found is None:
            raise NginxError(f"nginx binary {binary} does not exist or is not executable")
    else:
        search = os.pathsep.join([os.environ.get("PATH", ""), *_SEARCH_DIRS])
        found = shutil.which("nginx", path=search)
        if found is None:
            raise NginxError(
                "nginx is not installed: the replicas need it as their gRPC proxy. Install it "
                "(Debian/Ubuntu: `sudo apt-get install nginx`; any nginx >= "
                f"{'.'.join(map(str, MIN_VERSION))} with the gRPC module, which distributions build in) "
                "or pass its path with --nginx"
            )
    result = subprocess.run([found, "-V"], capture_output=True, text=True, timeout=30)
    described = result.stderr + result.stdout
    match = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", described)
    if result.returncode != 0 or match is None:
        raise NginxError(f"{found} -V failed or printed no version: {described.strip()}")
    version = tuple(int(part) for part in match.groups())
    if version < MIN_VERSION:
        raise NginxError(
            f"{found} is nginx {'.'.join(map(str, version))}; the proxy needs "
            f"{'.'.join(map(str, MIN_VERSION))} or newer"
        )
    for module in ("http_grpc_module", "http_upstream_hash_module", "http_map_module"):
        if f"--without-{module}" in described:
            raise NginxError(f"{found} was built without {module}, which the proxy needs")
    if "--with-http_v2_module" not in described:
        raise NginxError(f"{found} was built without http_v2_module: it cannot serve gRPC")
    return NginxInstall(Path(found), version)


def _server_lines(addresses: Sequence[str], max_fails: int, fail_timeout_s: int, resolve: bool,
                  down: Collection[int] = ()) -> str:
    """One `server` line per replica; the replicas whose index is in `down` are marked `down`: they
    take no requests, and their keys go to the next replica on the ring."""
    options = f"max_fails={max_fails} fail_timeout={fail_timeout_s}s"
    if resolve:
        options = "resolve " + options
    return "\n".join(f"        server {address} {options}{' down' if index in down else ''};"
                     for index, address in enumerate(addresses))


def _listen_lines(address: str, http2: bool, http2_directive: bool) -> str:
    if not http2:
        return f"        listen {address};"
    if http2_directive:
        return f"        listen {address};\n        http2 on;"
    return f"        listen {address} http2;"


def _render(
    *,
    target: str,
    main_directives: Sequence[str],
    http_directives: Sequence[str],
    access_log: str,
    grpc_listen: str,
    http_listen: str,
    grpc_servers: Sequence[str],
    http_servers: Sequence[str],
    max_fails: int,
    fail_timeout_s: int,
    resolve: bool,
    http2_directive: bool,
    down: Collection[int] = (),
) -> str:
    if len(grpc_servers) != len(http_servers) or not grpc_servers:
        raise ValueError("one gRPC and one HTTP address per replica, at least one replica")
    if max_fails < 1 or fail_timeout_s < 1:
        raise ValueError(f"max_fails ({max_fails}) and fail_timeout_s ({fail_timeout_s}) must be >= 1")
    return _ConfigTemplate(TEMPLATE.read_text()).substitute(
        target=target,
        main_directives="\n".join(main_directives),
        http_directives="\n".join(f"    {line}" for line in http_directives),
        access_log=f"    access_log {access_log} code2wav_proxy;",
        grpc_listen=_listen_lines(grpc_listen, True, http2_directive),
        http_listen=_listen_lines(http_listen, False, http2_directive),
        grpc_servers=_server_lines(grpc_servers, max_fails, fail_timeout_s, resolve, down),
        http_servers=_server_lines(http_servers, max_fails, fail_timeout_s, resolve, down),
    )


def _worker_user() -> str | None:
    """The `user` directive's value when nginx starts as root (workers drop to it), else None: a
    non-root nginx cannot switch users and its workers run as the caller."""
    if os.geteuid() != 0:
        return None
    try:
        nobody = pwd.getpwnam("nobody")
        return f"nobody {grp.getgrgid(nobody.pw_gid).gr_name}"
    except KeyError:  # no such account here: workers keep root, as the launcher has
        return "root root"


def compose_config(replicas: int = COMPOSE_REPLICAS) -> str:
    """docker/nginx/compose.conf: the proxy of the compose `scale` profile (nginx >= 1.27.3 image).

    Each replica is a service of its own name, re-resolved through Docker's DNS (`resolve`), because
    nginx's consistent hash places a `server` on its ring by the name written here: the addresses of
    one name (`docker compose --scale`) would share one place and take its keys round-robin, which
    breaks affinity. `resolve` lets a recreated replica come back under a new address.
    """
    names = [COMPOSE_REPLICA_SERVICE.format(index=index) for index in range(replicas)]
    return _render(
        target=f"docker compose `scale` profile, {replicas} replicas",
        main_directives=["user nginx;", "worker_processes auto;", "pid /var/run/nginx.pid;",
                         "error_log /dev/stderr warn;"],
        # Docker's embedded DNS; `valid` bounds how long a replica's old address is used.
        http_directives=["resolver 127.0.0.11 valid=5s ipv6=off;"],
        access_log="/dev/stdout",
        grpc_listen="8001", http_listen="8000",
        grpc_servers=[f"{name}:8001" for name in names], http_servers=[f"{name}:8000" for name in names],
        max_fails=DEFAULT_MAX_FAILS, fail_timeout_s=DEFAULT_FAIL_TIMEOUT_S,
        resolve=True,
        http2_directive=True,
    )


def _children(pid: int) -> set[int]:
    """The pids of `pid`'s children (nginx's master: its workers)."""
    try:
        return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def _accepts(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class NginxProxy(ServerProcess):
    """One nginx on `host` serving gRPC on `grpc_port` and HTTP on `http_port`, in front of the
    replicas at `grpc_servers` / `http_servers` ("host:port", one of each per replica, same order;
    they may be set after construction, before `start()`).

    Its files live in `prefix`: nginx.conf, nginx.pid, error.log, access.log (one line per request:
    stream key, replica, statuses), output.log (what nginx prints before it opens its error log) and
    the temporary folders. Ports of 0 are picked free at start.
    """

    balances = True  # streams of a replica taken out go to the others (supervise says so)
    name = "nginx"
    error = NginxError
    ready_timeout_s = 10.0
    # SIGTERM is nginx's fast shutdown (open streams are closed): no drain to wait for. A master
    # killed outright leaves its workers running: stop() waits for the whole group.
    stop_grace_s = 10.0

    def __init__(
        self,
        prefix: Path | str,
        *,
        grpc_servers: Sequence[str] = (),
        http_servers: Sequence[str] = (),
        grpc_port: int = 8001,
        http_port: int = 8000,
        host: str = LOCALHOST,
        max_fails: int = DEFAULT_MAX_FAILS,
        fail_timeout_s: int = DEFAULT_FAIL_TIMEOUT_S,
        binary: Path | str | None = None,
    ):
        self.prefix = Path(prefix).resolve()
        super().__init__(host=host, grpc_port=grpc_port, http_port=http_port, log_path=self.prefix / "output.log")
        self.grpc_servers = list(grpc_servers)
        self.http_servers = list(http_servers)
        self.max_fails = max_fails
        self.fail_timeout_s = fail_timeout_s
        self.binary = binary
        self.install: NginxInstall | None = None
        # Replicas (indexes into grpc_servers) taken out of the proxy: see take_out().
        self.down: set[int] = set()

    @property
    def conf_path(self) -> Path:
        return self.prefix / "nginx.conf"

    @property
    def error_log(self) -> Path:
        return self.prefix / "error.log"

    @property
    def access_log(self) -> Path:
        return self.prefix / "access.log"

    def requests(self) -> list[ProxiedRequest]:
        """Every request with a stream key in the access log so far, in order."""
        return read_access_log(self.access_log)

    def _command(self, *extra: str) -> list[str]:
        cmd = [str(self.install.binary), "-p", f"{self.prefix}/", "-c", str(self.conf_path)]
        if self.install.version >= _ERROR_LOG_FLAG_VERSION:
            # Before reading the config nginx opens its compiled-in error log, which a non-root
            # user cannot write.
            cmd += ["-e", str(self.error_log)]
        return cmd + list(extra)

    def write_config(self) -> Path:
        """Find nginx, pick free ports where asked, write nginx.conf and check it with `nginx -t`."""
        self.install = find_nginx(self.binary)
        picked = iter(free_ports(sum(port is None for port in (self.grpc_port, self.http_port)), self.host))
        self.grpc_port = self.grpc_port or next(picked)
        self.http_port = self.http_port or next(picked)
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self.config_text())
        check = subprocess.run(self._command("-t", "-q"), capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise NginxError(
                f"nginx -t rejected {self.conf_path}:\n{(check.stderr + check.stdout).strip()}"
            )
        return self.conf_path

    def config_text(self) -> str:
        """nginx.conf for this proxy, in the foreground on this machine, every file it writes under
        `prefix`: nginx.pid, error.log, access.log and the temporary folders. Needs `install`."""
        main = ["daemon off;", "master_process on;", "worker_processes 1;", f"pid {self.prefix / 'nginx.pid'};",
                f"error_log {self.error_log} warn;"]
        user = _worker_user()
        if user is not None:
            main.insert(0, f"user {user};")
        http = [f"{kind}_temp_path {self.prefix / (kind + '_temp')};"
                for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")]
        return _render(
            target=f"local, {len(self.grpc_servers)} replicas",
            main_directives=main,
            http_directives=http,
            access_log=str(self.access_log),
            grpc_listen=self.grpc_url, http_listen=self.http_url,
            grpc_servers=self.grpc_servers, http_servers=self.http_servers,
            max_fails=self.max_fails, fail_timeout_s=self.fail_timeout_s,
            resolve=False,
            http2_directive=self.install.version >= _HTTP2_DIRECTIVE_VERSION,
            down=self.down,
        )

    def take_out(self, index: int) -> None:
        """Send no request to replica `index` until put_back(): its keys go to the next replica on
        the ring (a hung or draining replica, which passive checks would not take out)."""
        self._set_down(self.down | {index})

    def put_back(self, index: int) -> None:
        self._set_down(self.down - {index})

    def _set_down(self, down: set[int]) -> None:
        if down == self.down:
            return
        self.down = down
        self.reload()

    def reload(self, timeout_s: float = 10.0) -> None:
        """Rewrite and check the config, then have nginx load it (SIGHUP): new workers take new
        requests at once; the old ones finish the requests they hold, and their HTTP/2 connections
        are told to go away, so clients reconnect to the new workers. Returns once the new workers run."""
        self.write_config()
        before = _children(self.pid)
        os.kill(self.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while not (_children(self.pid) - before):
            if time.monotonic() > deadline or not self.is_alive():
                raise NginxError(f"nginx did not reload {self.conf_path} within {timeout_s:g} s {self.log_report()}")
            time.sleep(0.02)

    # ServerProcess -------------------------------------------------------------------------
    def _prepare(self) -> tuple[list[str], None]:
        """Write and check the config; nginx runs in the foreground (`daemon off`), master first.
        Without stop() (this process killed) the master gets SIGTERM and takes its workers down."""
        self.write_config()
        return self._command(), None

    def readiness(self) -> str | None:
        """Both ports accept connections."""
        if _accepts(self.host, self.grpc_port) and _accepts(self.host, self.http_port):
            return None
        return f"not listening on {self.grpc_url} and {self.http_url}"

    def log_report(self) -> str:
        return f"(error log {self.error_log}):\n{log_tail(self.error_log)}\n{log_tail(self.log_path)}"
