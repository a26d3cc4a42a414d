"""Make a private CA with server and client certificates, for trying TLS (`code2wav-server certs`).

The access folder of TLS and keys (docs/design.md §5.3) that `serve` writes from its options: the entrypoint script
(`ENTRYPOINT`) alone maps it to tritonserver's flags. No log line or error message quotes a key."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

from mimi_code2wav.client.credentials import KEY_ENV

from .processes import ServerError

ADMIN_KEY_ENV = "CODE2WAV_ADMIN_KEY"
# The entrypoint every server runs under: watches health and the Python stubs, maps the access folder.
ENTRYPOINT = Path(__file__).with_name("triton-watchdog.sh")


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


def write_access_folder(folder: Path, args, environ=os.environ) -> Path:
    """`folder` (emptied first, private) with each file of `add_security_arguments`' options under the
    entrypoint's name, a key from the environment written as its file. Errors name a file, never a key."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, mode=0o700)
    sources = {"server.pem": (args.tls_cert, ""), "server.key": (args.tls_key, ""),
               "client-ca.pem": (args.tls_client_ca, ""), "inference.key": (args.key_file, KEY_ENV),
               "admin.key": (args.admin_key_file, ADMIN_KEY_ENV)}
    for name, (source, env_name) in sources.items():
        target = folder / name
        if source is not None:
            try:
                shutil.copyfile(source, target)
            except OSError as error:
                raise ServerError(f"cannot read {source} (for {name}): {error.strerror}") from None
        elif environ.get(env_name, "").strip():
            target.write_text(environ[env_name].strip() + "\n")
        if target.exists():
            target.chmod(0o600)
    return folder


def make_certificates(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), days: int = 30) -> Path:
    """A private CA and what it signs, made with openssl in `folder`: ca.pem/.key, server.pem/.key (valid
    for `hosts`), client.pem/.key (for mutual TLS). For trying TLS and for tests."""
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
    names = ",".join(f"IP:{host}" if _is_ip(host) else f"DNS:{host}" for host in hosts)
    (folder / "server.ext").write_text(f"subjectAltName={names}\n")
    for name, subject, extensions in (("server", hosts[0], ["-extfile", "server.ext"]), ("client", "code2wav client", [])):
        openssl("req", *new_key(name), "-out", f"{name}.csr", "-subj", f"/CN={subject}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", str(days), *extensions)
    for name in ("server.ext", "server.csr", "client.csr", "ca.srl"):
        (folder / name).unlink(missing_ok=True)
    for path in folder.glob("*.key"):
        path.chmod(0o600)
    return folder


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder to write ca.pem, server.pem/.key, client.pem/.key")
    parser.add_argument("--host", action="append", metavar="NAME", help="a name or address the server certificate "
                        "is valid for (repeatable; default localhost and 127.0.0.1)")
    parser.add_argument("--days", type=int, default=30, help="validity (default %(default)s days)")


def run(args) -> int:
    folder = make_certificates(args.out, tuple(args.host or ("localhost", "127.0.0.1")), args.days)
    print(f"wrote a private CA and certificates to {folder}: ca.pem (what clients trust), server.pem + server.key "
          "(--tls-cert, --tls-key), client.pem + client.key (mutual TLS: --tls-cert, --tls-key on the client); "
          "ca.key signs more and belongs nowhere near a server")
    return 0


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
