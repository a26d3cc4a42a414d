"""`python -m benchmarks front`: what the code2wav front costs per request, and where it goes.

The null decoder answers at once, so what is left is the front. Per count of front instances, one local
server holds code2wav and `minimal_front` (one `async_exec` per request, the cheapest Python BLS front)
with as many instances each, and measures: requests/s of `--unpaced` conversations of 1-frame requests
through each front in turn (`--rounds` rounds); `--conversations` live per-frame conversations through
each (duplex's driver), profiled; and the same again while py-spy (`--rate` Hz) samples each front's
stubs, charging every sample to numpy, a pb_utils call (the Python backend's C++ and its IPC), the
front's own Python, or asyncio and the threads. py-spy needs ptrace rights over the stubs (root, or
kernel.yama.ptrace_scope 0); without them that part is skipped. Writes OUT_DIR/front.md and front.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mimi_code2wav.client.protocol import FRAME_DURATION_S, StreamOptions, random_codes
from mimi_code2wav.export.render import COMMON_DIR
from mimi_code2wav.server.processes import group_pids

from .duplex import PER_FRAME, run_async
from .local_server import LocalServer, add_server_arguments
from .profile import process_role
from .provenance import REPO_ROOT, log, md_row, run_meta, write_run

FRONTS = ("code2wav", "minimal_front")
MINIMAL_FRONT = Path(__file__).resolve().parent / "minimal_front" / "model.py"
# Beside it as beside every Python model: the stub's fault handler and its collection at unload.
MODEL_LIFECYCLE = COMMON_DIR / "model_lifecycle.py"
# Where a sample's CPU goes, in the order the report lists them; the first three are the front's work.
PB_UTILS = "pb_utils calls (C++, IPC with tritonserver)"
PARTS = (PB_UTILS, "front Python", "numpy", "asyncio and threads", "other")
# A line of a front that calls into the Python backend's C++: tensors, requests, responses, metrics.
# (code2wav's decoder-call threads run nothing but decoder calls: `blocking_call()` is `request.exec`.)
PB_UTILS_CALL = re.compile(r"pb_utils\.|\.send\(|\.exec\b|async_exec|\.increment\(|as_numpy\(|get_response_sender|blocking_call\(\)")
# code2wav's decoder-call threads waiting for their next call (the work queue of an executor's threads).
THREAD_WAIT = re.compile(r"_calls\.get\(\)")
REQUESTS_PER_S_PER_CONVERSATION = 1 / FRAME_DURATION_S  # per-frame: one request per 80 ms frame


# ---- py-spy samples --------------------------------------------------------------------------------

def parse_raw(text: str) -> collections.Counter:
    """py-spy's raw format (`frame;...;frame COUNT`, outermost first, a frame `function (file:line)`) ->
    Counter of stacks."""
    stacks: collections.Counter = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def _location(frame: str) -> tuple[str, str, tuple[str, int]]:
    """(function, file, (file name, line)) of a frame: the last is how `sources` keys a line."""
    function, _, location = frame.rpartition(" (")
    file_name, _, line = location.rstrip(")").rpartition(":")
    return function, file_name, (os.path.basename(file_name), int(line) if line.isdigit() else 0)


def sources(model_folder: Path) -> dict[tuple[str, int], str]:
    """(file name, line number) -> the line, for every Python file a served model's folder holds."""
    return {(path.name, number): text for path in model_folder.glob("*.py")
            for number, text in enumerate(path.read_text().splitlines(), 1)}


def sample_part(stack: tuple[str, ...], front_sources: dict[tuple[str, int], str]) -> str:
    """The part of the stub a sample ran in: innermost numpy or the thread pool's work item (a BLS
    `exec`) first, else the innermost line of the front's own files (a pb_utils call by its text, a
    decoder-call thread waiting for work, else the front's Python), else asyncio or threading."""
    function, file_name, _ = _location(stack[-1])
    if "numpy/" in file_name:
        return "numpy"
    if file_name.endswith("concurrent/futures/thread.py") and function == "run":
        return PB_UTILS  # the pool runs nothing but decoder calls (request.exec, async_exec)
    for frame in reversed(stack):
        _, file_name, key = _location(frame)
        text = front_sources.get(key)
        if text is not None:
            if THREAD_WAIT.search(text):
                return "asyncio and threads"
            return PB_UTILS if PB_UTILS_CALL.search(text) else "front Python"
        if "asyncio/" in file_name or os.path.basename(file_name) in ("threading.py", "thread.py", "_base.py", "queue.py"):
            return "asyncio and threads"
    return "other"


def charge(stacks: collections.Counter, front_sources: dict[tuple[str, int], str]) -> tuple[dict, list]:
    """Samples per part, and the busiest innermost lines of the front's own files as (frame, the line's
    text, samples), counted from the samples of its work (not a thread waiting for its next call)."""
    parts = dict.fromkeys(PARTS, 0)
    lines: collections.Counter = collections.Counter()
    for stack, count in stacks.items():
        part = sample_part(stack, front_sources)
        parts[part] += count
        own = next((frame for frame in reversed(stack) if _location(frame)[2] in front_sources), None)
        if own is not None and part in PARTS[:3]:
            lines[own] += count
    return parts, [(frame, front_sources[_location(frame)[2]].strip(), count) for frame, count in lines.most_common(10)]


def py_spy() -> str | None:
    """The py-spy of this environment (beside its python), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def py_spy_problem() -> str | None:
    """Why py-spy cannot sample the stubs here, or None."""
    if py_spy() is None:
        return "py-spy is not installed (the serve extra pins it: make venv)"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.exists() and scope.read_text().strip() != "0":
        return "py-spy needs ptrace rights over the stubs: run as root, or with kernel.yama.ptrace_scope 0"
    return None


class Sampler:
    """py-spy recording each stub of `role` of a server's process group, from its return (every py-spy
    has attached and says it samples) until `stop()`."""

    def __init__(self, pgid: int, role: str, rate: int, folder: Path):
        self.pids = [pid for pid in group_pids(pgid) if process_role(pid) == role]
        self.outputs = [folder / f"{role.replace(' ', '-')}-{pid}.txt" for pid in self.pids]
        self._processes = [
            subprocess.Popen([py_spy() or "py-spy", "record", "--pid", str(pid), "--nonblocking", "--format",
                              "raw", "--rate", str(rate), "--output", str(output)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for pid, output in zip(self.pids, self.outputs)]
        self._said = []  # what each py-spy said until it began sampling (attaching takes a while) or exited
        for process in self._processes:
            said = []
            while (line := process.stdout.readline()) and not line.startswith("py-spy> Sampling"):
                said.append(line)
            self._said.append("".join(said))

    def stop(self) -> collections.Counter:
        stacks: collections.Counter = collections.Counter()
        for process, output, said in zip(self._processes, self.outputs, self._said):
            process.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            errors = said + process.communicate(timeout=60)[0]
            if not output.is_file():
                raise RuntimeError(f"py-spy wrote no samples: {errors.strip().splitlines()[-1:] or process.returncode}")
            stacks.update(parse_raw(output.read_text()))
        return stacks


# ---- the runs --------------------------------------------------------------------------------------

def unpaced_requests_per_s(url: str, model_name: str, conversations: int, seconds: float) -> float:
    """Requests/s of `conversations` 1-frame conversations of `model_name` for `seconds`, each sending
    its next request when the last is answered."""
    from mimi_code2wav.client.aio import Code2WavClient

    async def conversation(client, codes, until: float) -> int:
        answered = 0
        async with client.stream() as stream:
            while time.monotonic() < until:
                await stream.decode(codes[:, answered % codes.shape[1]][:, None])
                answered += 1
        return answered

    async def main() -> int:
        async with Code2WavClient(url, StreamOptions(model_name=model_name)) as client:
            await client.check_ready()
            until = time.monotonic() + seconds
            return sum(await asyncio.gather(*(conversation(client, random_codes(64, seed=i), until)
                                              for i in range(conversations))))

    began = time.monotonic()
    count = asyncio.run(main())
    return count / (time.monotonic() - began)


def add_minimal_front(repository: Path) -> None:
    """Serve `minimal_front` beside code2wav: code2wav's rendered config (same inputs, batching and
    instances) under the other name, its model file and model_lifecycle.py."""
    folder = repository / "minimal_front"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "1").mkdir(parents=True)
    config = (repository / "code2wav" / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(config.replace('name: "code2wav"', 'name: "minimal_front"', 1))
    shutil.copy(MINIMAL_FRONT, folder / "1" / "model.py")
    shutil.copy(MODEL_LIFECYCLE, folder / "1" / MODEL_LIFECYCLE.name)


def _live(local: LocalServer, front: str, args, sampler_folder: Path | None) -> dict:
    """One live point through `front`: the duplex result and its profile; with `sampler_folder`, the
    samples of the front's stubs instead of the profile."""
    profile = local.profile((front, "mimi_decoder")).start()
    sampler = Sampler(local.server.pid, f"stub {front}", args.rate, sampler_folder) if sampler_folder else None
    result = run_async(local.url, args.conversations, max(2, round(args.seconds / FRAME_DURATION_S)), PER_FRAME,
                       args.budget_ms, model_name=front)
    if sampler is None:
        return {"result": result, "profile": profile.finish(result["requests"])}
    parts, busiest = charge(sampler.stop(), sources(local.repository / front / "1"))
    return {"result": result, "samples": parts, "busiest_lines": busiest, "stubs": len(sampler.pids)}


def measure_instances(local: LocalServer, instances: int, args, sampling: str | None) -> dict:
    """Every part of the run for one count of front instances, on `local` (a null repository with
    that many front instances), run here with the minimal front added."""
    add_minimal_front(local.repository)
    point: dict = {"instances": instances, "rps": {front: [] for front in FRONTS}}
    with local.running():
        for front in FRONTS:  # warm-up
            unpaced_requests_per_s(local.url, front, args.unpaced, 1.0)
        for round_index in range(args.rounds):
            for front in FRONTS:
                point["rps"][front].append(unpaced_requests_per_s(local.url, front, args.unpaced, args.seconds))
            print(f"  {instances} instance(s), round {round_index + 1}: "
                  + ", ".join(f"{front} {point['rps'][front][-1]:.0f} requests/s" for front in FRONTS), flush=True)
        point["ratio"] = statistics.median(c / m for c, m in zip(point["rps"]["code2wav"], point["rps"]["minimal_front"]))
        point["live"] = {front: _live(local, front, args, None) for front in FRONTS}
        for front in FRONTS:
            live = point["live"][front]["result"]
            print(f"  {instances} instance(s), {args.conversations} live conversations through {front}: late p99 "
                  f"{live['late_ms']['p99']:.0f} ms, {live['misses']} misses", flush=True)
        if sampling is None:
            with tempfile.TemporaryDirectory(prefix="front-samples-") as folder:
                point["sampled"] = {front: _live(local, front, args, Path(folder)) for front in FRONTS}
    return point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, url=False, build_dir="bench-front")
    parser.set_defaults(decoder="null")
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2], help="front instance counts (default 1 2)")
    parser.add_argument("--conversations", type=int, default=64, help="live per-frame conversations (default %(default)s)")
    parser.add_argument("--unpaced", type=int, default=32, help="unpaced 1-frame conversations (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measurement (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="ABAB rounds of the throughput part (default %(default)s)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default %(default)s)")
    parser.add_argument("--budget-ms", type=float, default=80.0, help="playout budget of a frame (default %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench_results" / "front")


def run(args: argparse.Namespace) -> int:
    if args.decoder != "null":
        log("error: the front benchmark runs its own server with the null decoder (no --decoder)")
        return 2
    sampling = py_spy_problem()
    if sampling:
        log(f"warning: {sampling}; the CPU breakdown is skipped")
    points = []
    for count in args.instances:
        args.front_instances = count
        points.append(measure_instances(LocalServer.prepare(args), count, args, sampling))
    results = {"meta": run_meta("front"), "conversations": args.conversations, "unpaced": args.unpaced,
               "seconds": args.seconds, "rounds": args.rounds, "rate": args.rate, "budget_ms": args.budget_ms,
               "sampling": sampling, "points": points}
    write_run(args.out_dir, "front", results, front_markdown(results))
    return 1 if any(p["live"][f]["result"]["failed"] for p in points for f in FRONTS) else 0


# ---- the report ------------------------------------------------------------------------------------

def breakdown(point: dict, front: str) -> list[tuple[str, float]]:
    """(what, ms per request) of one front's live point: Triton's queue and execution, then the CPU
    of each process, the front's stubs split by the samples' shares."""
    profile = point["live"][front]["profile"]
    rows = []
    figures = profile.get(front) or {}
    if figures.get("requests"):
        rows += [("waiting in Triton's queue", figures["queue_ms_per_request"]),
                 ("execute (Triton's compute time of its batch)", figures["execute_ms"]),
                 ("(requests per execution)", figures["mean_batch"])]
    cpu = profile.get("server_cpu_ms_per_request", {})
    samples = (point.get("sampled") or {}).get(front, {}).get("samples")
    for role, label in (("tritonserver", "tritonserver"), (f"stub {front}", "front stub"), ("stub mimi_decoder", "decoder stub")):
        ms = cpu.get(role, 0.0)
        if label == "front stub" and samples and sum(samples.values()):
            rows += [(f"CPU: front stub, {part}", ms * count / sum(samples.values())) for part, count in samples.items()]
        rows.append((f"CPU: {label}", ms))
    return [*rows, ("CPU: load generator", profile.get("load_cpu_ms_per_request", 0.0))]


def front_markdown(results: dict) -> str:
    lines = ["Local tritonserver 2.51, the null decoder; code2wav and the minimal front (one async_exec per "
             "request) served side by side with as many instances each; client and server on the same cores.", "",
             f"Throughput: {results['unpaced']} unpaced conversations of 1-frame requests, {results['seconds']:g} s per "
             f"measurement, the two fronts in turn for {results['rounds']} rounds.", "",
             "| front instances | code2wav requests/s | minimal front requests/s | code2wav / minimal (median) |",
             "|---:|---:|---:|---:|"]
    lines += [md_row(point["instances"], *(f"{statistics.median(point['rps'][front]):.0f}" for front in FRONTS),
                     f"{point['ratio']:.2f}") for point in results["points"]]
    lines += ["", f"Live: {results['conversations']} per-frame conversations ticking every 80 ms, "
              f"{results['seconds']:g} s; a miss is a frame more than {results['budget_ms']:g} ms late.", "",
              "| front instances | front | late p50 / p99 ms | misses | server CPU ms / request | cores busy |",
              "|---:|---|---:|---:|---:|---:|"]
    for point in results["points"]:
        for front, live in point["live"].items():
            result, profile = live["result"], live["profile"]
            lines.append(md_row(point["instances"], front, f"{result['late_ms']['p50']:.0f} / {result['late_ms']['p99']:.0f}",
                                result["misses"], f"{profile.get('server_cpu_ms_per_request_total', float('nan')):.3f}",
                                f"{profile.get('server_cpu_cores_busy') or float('nan'):.2f}"))
    lines += ["", *sizing(results)]
    if results["sampling"]:
        lines += ["", f"CPU by part not measured: {results['sampling']}."]
    for point in results["points"]:
        lines += ["", f"Where a live request's time and CPU go, {point['instances']} front instance(s), py-spy at "
                  f"{results['rate']} Hz on the stubs:", "", "| | code2wav ms / request | minimal front ms / request |",
                  "|---|---:|---:|"]
        code2wav_rows, minimal_rows = (dict(breakdown(point, front)) for front in FRONTS)
        lines += [md_row(what, *("" if rows.get(what) is None else f"{rows[what]:.3f}" for rows in (code2wav_rows, minimal_rows)))
                  for what in dict.fromkeys([*code2wav_rows, *minimal_rows])]
        sampled = (point.get("sampled") or {}).get("code2wav")
        if sampled:
            lines += ["", "| code2wav's busiest lines (innermost of its own) | samples |", "|---|---:|"]
            lines += [md_row(f"`{frame}`: `{text}`", count) for frame, text, count in sampled["busiest_lines"]]
    return "\n".join(lines)


def sizing(results: dict) -> list[str]:
    """Host sizing from code2wav's live points: the server CPU a per-frame conversation costs, and the
    most conversations one front instance's process can carry (one core at most, under its GIL)."""
    lines = ["Sizing from the live code2wav runs (server CPU only; the null decoder, so the decoder's own "
             "cost comes on top; rerun on the serving host):", "",
             "| front instances | server CPU ms / request | per-frame conversations per server core | "
             "front stub CPU ms / request | per-frame conversations one front instance carries at most |",
             "|---:|---:|---:|---:|---:|"]
    for point in results["points"]:
        profile = point["live"]["code2wav"]["profile"]
        server_ms = profile.get("server_cpu_ms_per_request_total")
        stub_ms = profile.get("server_cpu_ms_per_request", {}).get("stub code2wav")
        if server_ms and stub_ms:  # the stubs' CPU per request, whichever instance served it
            lines.append(md_row(point["instances"], f"{server_ms:.3f}", f"{1000 / server_ms / REQUESTS_PER_S_PER_CONVERSATION:.0f}",
                                f"{stub_ms:.3f}", f"{1000 / stub_ms / REQUESTS_PER_S_PER_CONVERSATION:.0f}"))
    return [*lines, "", "Cores for N per-frame conversations: N x 12.5 requests/s x the server CPU per request; front "
            "instances: N over the last column, at least."]
