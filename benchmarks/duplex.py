"""`python -m benchmarks duplex`: the duplex tick, what a full-duplex speech pipeline feels.

    python -m benchmarks duplex [--url HOST:PORT | --decoder python-ort|null] [--conversations 4,8,16,32,64,128,200]
                           [--policies per-frame,ramp,catch-up] [--seconds 8] [--budget-ms 80]
                           [--compare-at 32] [--out-dir bench_results/duplex]

N conversations tick together: every 80 ms each produces one frame of codes, and wants that frame's
PCM within its playout budget. How frames become requests is the pipeline's policy:

    per-frame  every frame its own request, sent at its tick (or, while the previous request of the
               conversation is still out, as soon as it returns: one request in flight)
    ramp       a first request of `first_frames` frames (1), then requests of `chunk_frames` (5), each
               sent once its last frame exists (vLLM-Omni's PersonaPlex: 1 then 5)
    catch-up   one request in flight; each carries every frame produced since the last one

Per frame: latency from its tick to its PCM's arrival, and how late it is against its due time (the
moment the policy lets its request leave: its own tick, or for ramp the tick of its chunk's last
frame). A frame misses when it is later than the budget. The load generator's CPU per request is
measured around the run (all of this process's threads).

`run_async` drives the conversations from one event loop with the asyncio client (one channel);
`run_threads` drives them with the thread client, one thread and connection per conversation.

An unmeasured warm-up (the most conversations, WARM_UP_FRAMES ticks) pays the server's one-off costs
first. For each policy the conversations grow through `--conversations` until a point misses the budget at
p99 (or through all of them, `--keep-going`); every point is profiled (the server's CPU per request
by process, Triton's queue and execution times per model, the load generator's CPU) and the report
says where the time goes at the first that misses. Then both clients run the per-frame policy at
`--compare-at` conversations, back to back. Without --url a local server is started as `sweep` does
(seeded random weights; `--decoder null` measures the front's own ceiling). Results: OUT_DIR/duplex.json
(`python -m benchmarks record --add` records it) and duplex.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mimi_code2wav.client.credentials import PLAINTEXT, Credentials, add_credentials_arguments, credentials_from_args
from mimi_code2wav.client.protocol import FRAME_DURATION_S, MODEL_NAME, SAMPLES_PER_FRAME, ClientError
from mimi_code2wav.client.report import percentiles
from mimi_code2wav.server.processes import ServerError

from .local_server import LocalServer, add_server_arguments, measured_server
from .profile import settle_gc
from .provenance import REPO_ROOT, command_line, parse_counts, run_meta, write_run


@dataclass(frozen=True)
class Policy:
    """How a conversation's produced frames become requests (module docstring)."""

    name: str
    first_frames: int = 1
    chunk_frames: int = 1
    catch_up: bool = False

    def __post_init__(self):
        if self.first_frames < 1 or self.chunk_frames < 1:
            raise ValueError(f"policy {self.name}: chunk sizes must be >= 1")

    def chunk_end(self, sent: int, total: int) -> int:
        """The frame after the request that starts at frame `sent` (without catch-up)."""
        size = self.first_frames if sent == 0 else self.chunk_frames
        return min(total, sent + size)

    def frames_to_send(self, produced: int, sent: int, total: int) -> int:
        """Frames to send now, given `produced` frames exist and `sent` were sent (0: wait)."""
        if produced <= sent:
            return 0
        if self.catch_up:
            return produced - sent
        stop = self.chunk_end(sent, total)
        return stop - sent if produced >= stop else 0

    def due_s(self, frame: int, total: int, start_s: float) -> float:
        """When frame `frame`'s request may leave at the earliest: the tick of its chunk's last frame."""
        if self.catch_up:
            return start_s + frame * FRAME_DURATION_S
        sent = 0
        while True:
            stop = self.chunk_end(sent, total)
            if frame < stop:
                return start_s + (stop - 1) * FRAME_DURATION_S
            sent = stop

    @property
    def label(self) -> str:
        if self.catch_up:
            return "catch-up"
        if self.first_frames == self.chunk_frames == 1:
            return "per-frame"
        return f"ramp {self.first_frames}+{self.chunk_frames}"


PER_FRAME = Policy("per-frame")
RAMP = Policy("ramp", first_frames=1, chunk_frames=5)
CATCH_UP = Policy("catch-up", catch_up=True)
POLICIES = {"per-frame": PER_FRAME, "ramp": RAMP, "catch-up": CATCH_UP}


@dataclass
class ConversationLog:
    """One conversation's frames: arrival time of each frame's PCM, and its requests."""

    frames: int
    arrival_s: np.ndarray = field(init=False)
    requests: int = 0

    def __post_init__(self):
        self.arrival_s = np.full(self.frames, np.nan)


@dataclass(frozen=True)
class TickResult:
    """One run: `conversations` conversations of `frames` frames under `policy`."""

    client: str
    policy: str
    conversations: int
    frames: int
    budget_ms: float
    latency_ms: dict  # p50 / p99 / max, frame tick to PCM
    late_ms: dict  # p50 / p99 / max, frame due time to PCM
    misses: int  # frames later than the budget past their due time
    requests: int
    client_cpu_ms_per_request: float
    wall_s: float
    failed: str | None = None

    @property
    def meets_budget(self) -> bool:
        return self.failed is None and self.late_ms["p99"] <= self.budget_ms

    def as_dict(self) -> dict:
        return {**self.__dict__, "meets_budget": self.meets_budget}


def summarize(client: str, policy: Policy, logs: Sequence[ConversationLog], start_s: float, budget_ms: float,
              cpu_s: float, wall_s: float, failed: str | None = None) -> TickResult:
    frames = logs[0].frames if logs else 0
    ticks = start_s + np.arange(frames) * FRAME_DURATION_S
    due = np.array([policy.due_s(j, frames, start_s) for j in range(frames)])
    arrivals = np.stack([log.arrival_s for log in logs]) if logs else np.zeros((0, frames))
    done = ~np.isnan(arrivals)
    latency_ms = ((arrivals - ticks) * 1e3)[done]
    late_ms = ((arrivals - due) * 1e3)[done]
    requests = sum(log.requests for log in logs)
    return TickResult(
        client=client, policy=policy.label, conversations=len(logs), frames=frames, budget_ms=budget_ms,
        latency_ms=percentiles(latency_ms, empty=math.nan), late_ms=percentiles(late_ms, empty=math.nan),
        misses=int((late_ms > budget_ms).sum()) + int((~done).sum()), requests=requests,
        client_cpu_ms_per_request=cpu_s * 1e3 / max(requests, 1), wall_s=wall_s, failed=failed)


# ---- drivers ---------------------------------------------------------------------------------------

AsyncDecode = Callable[[np.ndarray, bool], Awaitable[np.ndarray]]


def _conversation(codes: np.ndarray, policy: Policy, start_s: float, log: ConversationLog
                  ) -> Generator[float | tuple[int, int], np.ndarray | None, None]:
    """One conversation's schedule, without I/O: yields a wait (seconds) or a request ([sent, stop):
    its frames, END with the last one), and is sent the request's PCM back, which it logs and checks."""
    total, sent = codes.shape[1], 0
    while sent < total:
        now = time.perf_counter()
        produced = min(total, int((now - start_s) / FRAME_DURATION_S) + 1) if now >= start_s else 0
        count = policy.frames_to_send(produced, sent, total)
        if count == 0:
            yield max(0.0, start_s + produced * FRAME_DURATION_S - now)
            continue
        stop = sent + count
        pcm = yield sent, stop
        log.arrival_s[sent:stop] = time.perf_counter()
        log.requests += 1
        if pcm.size != count * SAMPLES_PER_FRAME:
            raise RuntimeError(f"expected {count * SAMPLES_PER_FRAME} samples, got {pcm.size}")
        sent = stop


async def _conversation_async(decode: AsyncDecode, codes: np.ndarray, policy: Policy, start_s: float,
                              log: ConversationLog) -> None:
    steps, answer = _conversation(codes, policy, start_s, log), None
    total = codes.shape[1]
    with contextlib.suppress(StopIteration):
        while True:
            step = steps.send(answer)
            if isinstance(step, float):
                await asyncio.sleep(step)
                answer = None
            else:
                answer = await decode(codes[:, step[0] : step[1]], step[1] == total)


def _conversation_thread(decode: Callable[[np.ndarray, bool], np.ndarray], codes: np.ndarray, policy: Policy,
                         start_s: float, log: ConversationLog, stop_event: threading.Event) -> None:
    steps, answer = _conversation(codes, policy, start_s, log), None
    total = codes.shape[1]
    with contextlib.suppress(StopIteration):
        while not stop_event.is_set():
            step = steps.send(answer)
            if isinstance(step, float):
                stop_event.wait(step)
                answer = None
            else:
                answer = decode(codes[:, step[0] : step[1]], step[1] == total)


def _codes(conversations: int, frames: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2048, (8, frames), dtype=np.int64) for _ in range(conversations)]


def run_threads(url: str, conversations: int, frames: int, policy: Policy, budget_ms: float,
                seed: int = 0, timeout_s: float = 30.0, credentials: Credentials = PLAINTEXT) -> TickResult:
    """The conversations on the thread client: one `Code2WavStream` (its own connection) and one
    thread each."""
    from mimi_code2wav.client.protocol import StreamOptions
    from mimi_code2wav.client.sync import Code2WavClient

    codes = _codes(conversations, frames, seed)
    logs = [ConversationLog(frames) for _ in codes]
    client = Code2WavClient(url, StreamOptions(response_timeout_s=timeout_s), credentials=credentials)
    streams = [client.stream() for _ in codes]
    stop_event, failures = threading.Event(), []
    start_s = time.perf_counter() + 0.5
    cpu_start_s = time.process_time()

    def run(index: int) -> None:
        try:
            _conversation_thread(streams[index].decode, codes[index], policy, start_s, logs[index], stop_event)
        except Exception as exc:  # one failure stops the run; the result says which
            failures.append(f"conversation {index}: {exc}")
            stop_event.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu_s, wall_s = time.process_time() - cpu_start_s, time.perf_counter() - start_s
    for stream in streams:
        stream.close()
    return summarize("threads", policy, logs, start_s, budget_ms, cpu_s, wall_s, failures[0] if failures else None)


def run_async(url: str, conversations: int, frames: int, policy: Policy, budget_ms: float,
              seed: int = 0, timeout_s: float = 30.0, credentials: Credentials = PLAINTEXT,
              model_name: str = MODEL_NAME) -> TickResult:
    """The conversations on the asyncio client: one `Code2WavClient` (one channel), one task each."""
    from mimi_code2wav.client.aio import Code2WavClient
    from mimi_code2wav.client.protocol import StreamOptions

    codes = _codes(conversations, frames, seed)
    logs = [ConversationLog(frames) for _ in codes]

    async def main() -> tuple[float, float, float, str | None]:
        options = StreamOptions(model_name=model_name, response_timeout_s=timeout_s)
        async with Code2WavClient(url, options, credentials=credentials) as client:
            streams = [client.stream() for _ in codes]
            start_s = time.perf_counter() + 0.5
            cpu_start_s = time.process_time()
            tasks = [asyncio.create_task(_conversation_async(stream.decode, c, policy, start_s, log))
                     for stream, c, log in zip(streams, codes, logs)]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            failures = [f"conversation {tasks.index(t)}: {t.exception()}" for t in done if t.exception()]
            cpu_s, wall_s = time.process_time() - cpu_start_s, time.perf_counter() - start_s
            return start_s, cpu_s, wall_s, failures[0] if failures else None

    start_s, cpu_s, wall_s, failed = asyncio.run(main())
    return summarize("asyncio", policy, logs, start_s, budget_ms, cpu_s, wall_s, failed)


# ---- the command -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_credentials_arguments(parser)  # for --url: a server with TLS or a key
    parser.add_argument("--conversations", type=parse_counts, default=[4, 8, 16, 32, 64, 128, 200],
                        help="conversations per point, tried in turn until one misses (default 4,8,16,32,64,128,200)")
    parser.add_argument("--policies", default="per-frame,ramp,catch-up",
                        help=f"comma-separated, of {', '.join(POLICIES)} (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each conversation (default %(default)s)")
    parser.add_argument("--budget-ms", type=float, default=80.0,
                        help="playout budget: how late past its due time a frame's PCM may be (default %(default)s)")
    parser.add_argument("--compare-at", type=int, default=32,
                        help="conversations at which the asyncio and the thread client both run (0: skip; default %(default)s)")
    parser.add_argument("--keep-going", action="store_true",
                        help="measure every count of --conversations, also past the first that misses")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="each request's deadline (default %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench_results" / "duplex",
                        help="where results go (default bench_results/duplex/)")


def _profiled(local: LocalServer | None, point: Callable[[], TickResult]) -> tuple[TickResult, dict | None]:
    settle_gc()
    profile = local.profile() if local is not None else None
    if profile is not None:
        profile.start()
    result = point()
    return result, (profile.finish(result.requests) if profile is not None else None)


def _print_row(result: TickResult) -> None:
    print(f"  {result.client:8} {result.policy:10} {result.conversations:4} conversations: frame latency p50/p99/max "
          f"{result.latency_ms['p50']:.0f}/{result.latency_ms['p99']:.0f}/{result.latency_ms['max']:.0f} ms, "
          f"late p99 {result.late_ms['p99']:.0f} ms, {result.misses} misses, "
          f"{result.client_cpu_ms_per_request:.2f} ms client CPU/request"
          + (f" FAILED: {result.failed}" if result.failed else ""), file=sys.stderr, flush=True)


# Unmeasured: the first requests of a server pay one-off costs (sequence slots, state rows, the
# decoder's first run at each batch size), so a warm-up runs the most conversations for this many ticks.
WARM_UP_FRAMES = 6


def measure(url: str, args: argparse.Namespace, local: LocalServer | None,
            credentials: Credentials = PLAINTEXT) -> dict:
    frames = max(2, round(args.seconds / FRAME_DURATION_S))
    points, most = [], {}
    from mimi_code2wav.client.sync import Code2WavClient

    Code2WavClient(url, credentials=credentials).check_ready()  # a bad credential stops here, in one line
    client = {"timeout_s": args.timeout_s, "credentials": credentials}
    warm_up = run_async(url, max(args.conversations), WARM_UP_FRAMES, PER_FRAME, args.budget_ms, **client)
    print(f"  warm-up ({warm_up.conversations} conversations, {WARM_UP_FRAMES} frames each, not measured)"
          + (f" FAILED: {warm_up.failed}" if warm_up.failed else ""), file=sys.stderr, flush=True)
    for name in args.policies.split(","):
        policy = POLICIES[name.strip()]
        most[policy.label] = 0
        for count in args.conversations:
            result, profile = _profiled(local, functools.partial(run_async, url, count, frames, policy,
                                                                 args.budget_ms, **client))
            _print_row(result)
            points.append({**result.as_dict(), "profile": profile})
            if result.meets_budget and all(p["meets_budget"] for p in points if p["policy"] == policy.label):
                most[policy.label] = count
            elif not args.keep_going:
                break
    compared = []
    if args.compare_at:
        for run_point in (run_async, run_threads):
            settle_gc()
            result = run_point(url, args.compare_at, frames, PER_FRAME, args.budget_ms, **client)
            _print_row(result)
            compared.append(result.as_dict())
    return {"points": points, "most_conversations": most, "compared": compared, "frames": frames,
            "warm_up": {"conversations": warm_up.conversations, "frames": WARM_UP_FRAMES}}


def run(args: argparse.Namespace) -> int:
    unknown = [name for name in args.policies.split(",") if name.strip() not in POLICIES]
    if unknown:
        print(f"error: unknown policies {unknown}; choose from {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        credentials = credentials_from_args(args)
        with measured_server(args) as local:
            results = measure(args.url or local.url, args, local, credentials)
    except (ClientError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    kind = f"duplex-{args.decoder}" if not args.url else "duplex-url"
    results["meta"] = {**run_meta(kind, command_line()), "budget_ms": args.budget_ms,
                       "decoder": None if args.url else args.decoder,
                       "server": local.description if local is not None else f"running server at {args.url}"}
    write_run(args.out_dir, "duplex", results, duplex_markdown(results))
    return 1 if any(point["failed"] for point in results["points"] + results["compared"]) else 0


# ---- the report ------------------------------------------------------------------------------------

def _where_the_time_goes(point: dict) -> str:
    profile = point.get("profile") or {}
    parts = []
    for model in ("code2wav", "mimi_decoder"):
        figures = profile.get(model)
        if figures and figures.get("requests"):
            parts.append(f"{model}: queue {figures['queue_ms_per_request']:.1f} ms, execution "
                         f"{figures['execute_ms']:.1f} ms at batch {figures['mean_batch']:.1f}")
    if "server_cpu_cores_busy" in profile and profile["server_cpu_cores_busy"] is not None:
        roles = profile["server_cpu_ms_per_request"]
        parts.append("server CPU per request " + ", ".join(f"{role} {ms:.2f} ms" for role, ms in roles.items())
                     + f" ({profile['server_cpu_cores_busy']:.2f} cores busy)")
    parts.append(f"load generator {point['client_cpu_ms_per_request']:.2f} ms CPU per request")
    return "; ".join(parts)


def duplex_markdown(results: dict) -> str:
    """The duplex table, the most conversations per policy, where the time goes at the first miss, and
    the two clients side by side (the caller writes the stamp)."""
    meta = results["meta"]
    lines = [
        f"{meta.get('server', '')}. Conversations tick together every 80 ms, one frame each per tick, "
        f"{results['frames']} frames each; latency from a frame's tick to its PCM; late = past the moment "
        f"its request could leave; a miss is a frame later than the {meta['budget_ms']:g} ms budget"
        + ("; after an unmeasured warm-up, the load generator's objects frozen before each point (`gc.freeze`)."
           if results.get("warm_up") else "."),
        "",
        "| policy | conversations | frame latency p50 / p99 / max ms | late p99 ms | misses | requests | client CPU ms / request |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for point in results["points"]:
        latency = point["latency_ms"]
        failed = f" (failed: {point['failed']})" if point["failed"] else ""
        lines.append(f"| {point['policy']} | {point['conversations']} | {latency['p50']:.0f} / {latency['p99']:.0f} / "
                     f"{latency['max']:.0f} | {point['late_ms']['p99']:.0f} | {point['misses']} | {point['requests']} | "
                     f"{point['client_cpu_ms_per_request']:.2f}{failed} |")
    lines += ["", "Most conversations within the budget at p99: "
              + ", ".join(f"{policy} {count}" for policy, count in results["most_conversations"].items()) + "."]
    first_misses = {}
    for point in results["points"]:
        if not point["meets_budget"]:
            first_misses.setdefault(point["policy"], point)
    for policy, point in first_misses.items():
        lines.append(f"- Where the time goes at {point['conversations']} conversations, {policy}: "
                     + _where_the_time_goes(point) + ".")
    if results["compared"]:
        lines += ["", "| client, per-frame | conversations | frame latency p50 / p99 ms | client CPU ms / request |",
                  "|---|---:|---:|---:|"]
        for point in results["compared"]:
            lines.append(f"| {point['client']} | {point['conversations']} | {point['latency_ms']['p50']:.0f} / "
                         f"{point['latency_ms']['p99']:.0f} | {point['client_cpu_ms_per_request']:.2f} |")
    return "\n".join(lines)

