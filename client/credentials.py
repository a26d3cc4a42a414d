"""A client's TLS (mutual too) and inference key (docs/design.md §5.3); the key is never printed nor in a repr."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .protocol import ClientError

# Triton's HTTP endpoint checks the header as named, gRPC as GRPC_RESTRICTED_PREFIX + name.
KEY_HEADER = "code2wav-key"
GRPC_RESTRICTED_PREFIX = "triton-grpc-protocol-"
KEY_ENV = "CODE2WAV_KEY"


def check_key(key: str, where: str) -> str:
    """A key is one printable header value: not empty, no whitespace or control characters."""
    if not key:
        raise ClientError(f"{where} is empty")
    if any(ch.isspace() or not ch.isprintable() for ch in key):
        raise ClientError(f"{where} holds whitespace or control characters (a key is one word)")
    return key


@dataclass(frozen=True)
class Credentials:
    """TLS and the inference key (default: plaintext, no key). `tls`: trust the system's CAs unless `tls_ca` (a
    PEM, implies TLS); `tls_cert`, `tls_key`: for mutual TLS; `key`: sent with every call."""

    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    key: str | None = field(default=None, repr=False)

    uses_tls = property(lambda self: self.tls or any((self.tls_ca, self.tls_cert, self.tls_key)))

    @classmethod
    def from_options(cls, tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                     tls_key: str | None = None, key_file: str | None = None,
                     environ: dict | None = None) -> Credentials:
        """Checked Credentials from a command line or settings: the key from `key_file`, else $CODE2WAV_KEY."""
        environ, key = os.environ if environ is None else environ, None
        if key_file:
            try:
                text = Path(key_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or exc
                raise ClientError(f"cannot read the key file {key_file}: {reason}") from None
            key = check_key(text, f"the key in {key_file}")
        elif environ.get(KEY_ENV):
            key = check_key(environ[KEY_ENV].strip(), f"the key in ${KEY_ENV}")
        credentials = cls(tls=tls, tls_ca=tls_ca or None, tls_cert=tls_cert or None, tls_key=tls_key or None, key=key)
        credentials.validate()
        return credentials

    def validate(self) -> None:
        """Raise ClientError unless the files are readable and the client certificate and key pair up."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ClientError("mutual TLS needs both the client certificate (tls_cert) and its key (tls_key)")
        for what, path in (("CA", self.tls_ca), ("client certificate", self.tls_cert), ("client key", self.tls_key)):
            if path and not os.access(path, os.R_OK):
                raise ClientError(f"the TLS {what} file {path} is missing or unreadable")
        if self.key is not None:
            check_key(self.key, "the key")

    def channel_credentials(self):
        """grpc.ChannelCredentials for a secure channel, or None for plaintext."""
        if not self.uses_tls:
            return None
        import grpc

        ca, key, chain = (Path(path).read_bytes() if path else None
                          for path in (self.tls_ca, self.tls_key, self.tls_cert))
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)

    def headers(self) -> dict[str, str]:
        """The gRPC metadata every call carries: the inference key, when there is one."""
        return {GRPC_RESTRICTED_PREFIX + KEY_HEADER: self.key} if self.key else {}

    def key_refused(self, url: str) -> str:
        if self.key is None:
            return (f"Triton at {url} requires the inference key (header {KEY_HEADER}), and none was given: "
                    f"give it with --key-file or ${KEY_ENV}")
        return f"Triton at {url} refused the inference key given (header {KEY_HEADER}): wrong key"

    def connection_hint(self, reason: str) -> str | None:
        """What gRPC's `reason` for a failed connection says about TLS, or None."""
        if "CERTIFICATE_VERIFY_FAILED" in reason:
            trusted = f"the CA in {self.tls_ca}" if self.tls_ca else "the system's CAs (give --tls-ca)"
            return f"the server's TLS certificate is not trusted: it is not signed by {trusted}, or names another host"
        if "WRONG_VERSION_NUMBER" in reason:
            return "the TLS handshake failed: the server does not speak TLS on this port (connect without TLS)"
        if "handshake failed" in reason:
            return "the TLS handshake failed"
        if "http1.x server" in reason and not self.uses_tls:  # a proxy's TLS port (nginx: HTTP 400)
            return "the server answered in HTTP/1: it expects TLS (give --tls-ca, or --tls), or this is its HTTP port"
        if "socket closed" in reason.lower():
            if self.uses_tls:
                return ("the server closed the TLS connection: it requires a client certificate (mutual TLS: "
                        "--tls-cert and --tls-key) from a CA it trusts")
            return "the server closed the connection at once: it expects TLS (give --tls-ca, or --tls)"
        return None


PLAINTEXT = Credentials()  # frozen: safe as a default argument


def add_credentials_arguments(parser) -> None:
    """`Credentials.from_options`'s command-line options, as an argument group of `parser`."""
    group = parser.add_argument_group(
        "TLS and key", f"For a server started with TLS or a key (docs/design.md §5.3). The key comes from --key-file, "
        f"else from ${KEY_ENV}; it is never printed.")
    group.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    group.add_argument("--tls-ca", metavar="PEM", help="CA certificate(s) that signed the server's certificate (implies --tls)")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate chain, for mutual TLS (with --tls-key)")
    group.add_argument("--tls-key", metavar="PEM", help="client private key, for mutual TLS")
    group.add_argument("--key-file", metavar="FILE", help=f"file holding the inference key (default: ${KEY_ENV})")


def credentials_from_args(args) -> Credentials:
    """The Credentials of parsed `add_credentials_arguments` options. Raises ClientError."""
    return Credentials.from_options(args.tls, args.tls_ca, args.tls_cert, args.tls_key, args.key_file)
