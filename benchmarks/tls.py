"""What TLS and the inference key cost: requests/s through the null decoder, plaintext against TLS.

    python -m benchmarks tls [--conversations 32] [--seconds 5] [--rounds 3] [--build-dir build/bench-tls]
                             [--out-dir bench_results/tls]

Two servers of the same null repository (the decoder answers silence at once, so the front and the
transport are all there is to measure) run side by side: one plaintext, one with TLS on gRPC and an
inference and an admin key (`server.security`, certificates from a private CA made for the run). The
asyncio client drives N conversations of 1-frame requests, each sent when the previous one is
answered, against each server in turn, ABAB for `--rounds` rounds, so that the machine's drift falls
on both alike. The table gives each round's requests/s and the ratio TLS / plaintext (the median of
the rounds). The client runs on the same cores as the servers, and pays its own share of TLS.
Writes tls.md and tls.json to the out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import MODEL_NAME

from .provenance import command_line, run_meta, write_run

KEY = "bench-inference-key"
ADMIN_KEY = "bench-admin-key"


async def _conversation(client, codes: np.ndarray, until: float) -> int:
    """1-frame requests until `until`; returns how many were answered."""
    answered = 0
    async with client.stream() as stream:
        while time.monotonic() < until:
            await stream.decode(codes[:, answered % codes.shape[1]][:, None])
            answered += 1
    return answered


def measure(url: str, credentials, conversations: int, seconds: float, model_name: str = MODEL_NAME) -> float:
    """Requests/s of `conversations` unpaced 1-frame conversations of `model_name` for `seconds`."""
    from mimi_code2wav.client.aio import Code2WavClient
    from mimi_code2wav.client.protocol import StreamOptions, random_codes

    async def main() -> int:
        async with Code2WavClient(url, StreamOptions(model_name=model_name), credentials=credentials) as client:
            await client.check_ready()
            until = time.monotonic() + seconds
            counts = await asyncio.gather(*(_conversation(client, random_codes(64, seed=i), until)
                                            for i in range(conversations)))
        return sum(counts)

    began = time.monotonic()
    count = asyncio.run(main())
    return count / (time.monotonic() - began)


def tls_markdown(results: dict) -> str:
    lines = [f"{results['conversations']} unpaced conversations of 1-frame requests through the null decoder, "
             f"{results['seconds']:g} s per measurement, plaintext and TLS with the inference and admin keys in "
             "turn (ABAB); client and servers on the same cores.", "",
             "| round | plaintext requests/s | TLS + key requests/s | TLS / plaintext |", "|---:|---:|---:|---:|"]
    for i, (plain, tls) in enumerate(zip(results["plaintext_rps"], results["tls_rps"]), 1):
        lines.append(f"| {i} | {plain:.0f} | {tls:.0f} | {tls / plain:.2f} |")
    lines.append(f"| median | {statistics.median(results['plaintext_rps']):.0f} | "
                 f"{statistics.median(results['tls_rps']):.0f} | {results['ratio']:.2f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--build-dir", type=Path, default=Path("build") / "bench-tls")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results") / "tls")


def run(args: argparse.Namespace) -> int:
    from mimi_code2wav.client.credentials import Credentials
    from mimi_code2wav.export.pipeline import prepare_local_repository
    from mimi_code2wav.server.security import ServerSecurity, make_certificates
    from mimi_code2wav.server.triton import running_server

    repository = prepare_local_repository(None, True, 0, args.build_dir, target="null")
    pki = make_certificates(args.build_dir / "pki")
    security = ServerSecurity(tls_cert=pki / "server.pem", tls_key=pki / "server.key", inference_key=KEY,
                              admin_key=ADMIN_KEY)
    plaintext_rps, tls_rps = [], []
    with running_server(repository, log_path=args.build_dir / "plaintext.log") as plain, \
            running_server(repository, log_path=args.build_dir / "tls.log", security=security) as secure:
        tls_url = f"localhost:{secure.grpc_port}"
        tls_credentials = Credentials(tls_ca=str(pki / "ca.pem"), key=KEY)
        measure(plain.grpc_url, Credentials(), args.conversations, 1.0)  # warm-up
        measure(tls_url, tls_credentials, args.conversations, 1.0)
        for round_index in range(args.rounds):
            plaintext_rps.append(measure(plain.grpc_url, Credentials(), args.conversations, args.seconds))
            tls_rps.append(measure(tls_url, tls_credentials, args.conversations, args.seconds))
            print(f"  round {round_index + 1}: plaintext {plaintext_rps[-1]:.0f} requests/s, TLS + key "
                  f"{tls_rps[-1]:.0f}", flush=True)
    results = {"meta": run_meta("tls", command_line()), "conversations": args.conversations, "seconds": args.seconds,
               "plaintext_rps": plaintext_rps, "tls_rps": tls_rps,
               "ratio": statistics.median(t / p for p, t in zip(plaintext_rps, tls_rps))}
    write_run(args.out_dir, "tls", results, tls_markdown(results))
    return 0
