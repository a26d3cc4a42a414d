"""TLS and the keys of a served tritonserver, with Triton's own mechanisms (docs/design.md §5.3).

- TLS on gRPC: `--grpc-use-ssl` (or `--grpc-use-ssl-mutual` with a client CA) and the server's
  certificate and key. Triton's HTTP endpoint has no TLS: with TLS on, `serve` keeps HTTP and
  metrics on loopback, for health probes and scrapes on the host.
- The inference key guards inference, metadata and model-config calls; the admin key guards
  model-repository, shared-memory, statistics, trace and logging calls. Both endpoints check them
  (`--grpc-restricted-protocol`, `--http-restricted-api`). Without an admin key the admin calls take
  the inference key. Health stays open, so that probes need no secret; metrics cannot be guarded by
  Triton, so their port stays on loopback or the internal network.

Triton takes a key only on its command line, so whoever can list this host's processes can read it:
serve it on a host (or container) of its own, or check the key in a proxy in front and give the
server none. Keys come from files or the environment, never from a rendered repository, and no log
line or error message of this package quotes one.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mimi_code2wav.client.credentials import ADMIN_KEY_HEADER, KEY_ENV, KEY_HEADER, check_key, read_secret
from mimi_code2wav.client.protocol import ClientError

from .processes import ServerError

ADMIN_KEY_ENV = "CODE2WAV_ADMIN_KEY"
INFERENCE_PROTOCOLS = ("inference", "metadata", "model-config")
ADMIN_PROTOCOLS = ("model-repository", "shared-memory", "statistics", "trace", "logging")


@dataclass(frozen=True)
class ServerSecurity:
    """What a tritonserver requires of its clients. `tls_cert`/`tls_key`: PEM files of the server's
    certificate chain and key (TLS on gRPC); `tls_client_ca`: a CA whose client certificates it
    requires (mutual TLS); `inference_key`, `admin_key`: see the module."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    inference_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def validate(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ServerError("TLS needs both the server certificate (--tls-cert) and its key (--tls-key)")
        if self.tls_client_ca is not None and not self.tls:
            raise ServerError("mutual TLS (--tls-client-ca) needs TLS: give --tls-cert and --tls-key too")
        for what, path in (("certificate", self.tls_cert), ("key", self.tls_key), ("client CA", self.tls_client_ca)):
            if path is not None and not os.access(path, os.R_OK):
                raise ServerError(f"the TLS {what} file {path} is missing or unreadable")
        if self.admin_key is not None and self.admin_key == self.inference_key:
            raise ServerError("the admin key must differ from the inference key")

    def tritonserver_args(self) -> list[str]:
        """tritonserver's options for these settings (they hold the keys: never print them)."""
        args = []
        if self.tls:
            args += [f"--grpc-use-ssl{'-mutual' if self.tls_client_ca else ''}=true",
                     f"--grpc-server-cert={Path(self.tls_cert).resolve()}",
                     f"--grpc-server-key={Path(self.tls_key).resolve()}"]
            if self.tls_client_ca:
                args.append(f"--grpc-root-cert={Path(self.tls_client_ca).resolve()}")
        groups = [(INFERENCE_PROTOCOLS, KEY_HEADER, self.inference_key), (ADMIN_PROTOCOLS, ADMIN_KEY_HEADER, self.admin_key)]
        if not self.admin_key:  # the admin calls take the inference key
            groups = [(INFERENCE_PROTOCOLS + ADMIN_PROTOCOLS, KEY_HEADER, self.inference_key)]
        for protocols, header, key in groups:
            if key:
                restriction = f"{','.join(protocols)}:{header}={key}"
                args += [f"--grpc-restricted-protocol={restriction}", f"--http-restricted-api={restriction}"]
        return args

    def probe_headers(self) -> dict[str, str]:
        """HTTP headers of an inference probe (the supervisor's stub probe)."""
        return {KEY_HEADER: self.inference_key} if self.inference_key else {}

    def describe(self) -> str:
        """One line for the serve banner, naming no secret."""
        parts = [("mutual TLS" if self.tls_client_ca else "TLS") + " on gRPC" if self.tls else "plaintext gRPC"]
        parts.append("inference key required" if self.inference_key else "no inference key")
        parts.append("admin key required" if self.admin_key else
                     "admin calls take the inference key" if self.inference_key else "admin calls open")
        return ", ".join(parts)


# No TLS, no key: a server on loopback (frozen: safe as a default argument).
OPEN = ServerSecurity()


def secret(path: str | Path | None, env_name: str, what: str, environ=None) -> str | None:
    """A key from a file (`path`), else from the environment variable `env_name`, else None.
    Raises ServerError naming the file or variable, never the key."""
    environ = os.environ if environ is None else environ
    try:
        if path:
            return read_secret(path, what)
        value = environ.get(env_name, "").strip()
        if value:
            check_key(value, f"the {what} in ${env_name}")
            return value
    except ClientError as error:
        raise ServerError(str(error)) from None
    return None


def add_security_arguments(parser) -> None:
    group = parser.add_argument_group(
        "TLS and keys", "Off by default (plaintext, no key, on loopback). Give them before serving beyond this "
        f"host (docs/design.md §5.3). Keys come from files, else ${KEY_ENV} and ${ADMIN_KEY_ENV}.")
    group.add_argument("--tls-cert", type=Path, metavar="PEM", help="the server's certificate chain: TLS on gRPC "
                       "(HTTP and metrics then stay on 127.0.0.1)")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="the server certificate's private key")
    group.add_argument("--tls-client-ca", type=Path, metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    group.add_argument("--key-file", type=Path, metavar="FILE",
                       help=f"the inference key, for inference and metadata calls (default: ${KEY_ENV})")
    group.add_argument("--admin-key-file", type=Path, metavar="FILE", help="the admin key, for repository, "
                       f"shared-memory, statistics, trace and logging calls (default: ${ADMIN_KEY_ENV})")


def security_from_args(args, environ=None) -> ServerSecurity:
    security = ServerSecurity(
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        inference_key=secret(args.key_file, KEY_ENV, "inference key", environ),
        admin_key=secret(args.admin_key_file, ADMIN_KEY_ENV, "admin key", environ),
    )
    security.validate()
    return security


def make_certificates(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), days: int = 30) -> Path:
    """A private CA and what it signs, made with openssl in `folder`: ca.pem/ca.key, server.pem/
    server.key (valid for `hosts`) and client.pem/client.key (for mutual TLS). For trying TLS and for
    tests; a deployment's certificates come from its own CA."""
    if shutil.which("openssl") is None:
        raise ServerError("making certificates needs openssl (Debian: apt-get install openssl)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise ServerError(f"openssl {args[0]} failed: {done.stderr.strip()}")

    def new_key(name: str) -> list[str]:
        return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key"]

    openssl("req", "-x509", *new_key("ca"), "-out", "ca.pem", "-days", str(days), "-subj", "/CN=code2wav private CA")
    names = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    (folder / "server.ext").write_text(f"subjectAltName={','.join(names)}\n")
    for name, subject, extensions in (("server", hosts[0], ["-extfile", "server.ext"]), ("client", "code2wav client", [])):
        openssl("req", *new_key(name), "-out", f"{name}.csr", "-subj", f"/CN={subject}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", str(days), *extensions)
    for name in ("server.ext", "server.csr", "client.csr", "ca.srl"):
        (folder / name).unlink(missing_ok=True)
    for path in folder.glob("*.key"):
        path.chmod(0o600)
    return folder


# `code2wav-server certs` ------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder to write ca.pem, server.pem/.key, client.pem/.key")
    parser.add_argument("--host", action="append", metavar="NAME",
                        help="a name or address the server certificate is valid for (repeatable; default "
                        "localhost and 127.0.0.1)")
    parser.add_argument("--days", type=int, default=30, help="validity (default %(default)s days)")


def run(args) -> int:
    """Make a private CA and its server and client certificates, for trying TLS."""
    try:
        folder = make_certificates(args.out, tuple(args.host or ("localhost", "127.0.0.1")), args.days)
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote a private CA and certificates to {folder}: ca.pem (what clients trust), server.pem + server.key "
          "(--tls-cert, --tls-key), client.pem + client.key (mutual TLS: --tls-cert, --tls-key on the client); "
          "ca.key signs more and belongs nowhere near a server")
    return 0
