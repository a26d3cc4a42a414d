"""What every benchmark shares: the stamp of its JSON (kind, machine, command, commit, date), timing a
call, writing a run. Standard library and numpy only: `gpu` runs where only torch, numpy and onnx are."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo ('AMD EPYC ...'), else what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_description(gpu: str | None = None) -> str:
    """'2 CPU cores (AMD EPYC ...), no GPU, Linux 6.1...'."""
    return f"{os.cpu_count()} CPU cores ({cpu_model()}), {gpu or 'no GPU'}, {platform.system()} {platform.release()}"


def git_commit() -> str:
    """The short commit of this checkout, marked when tracked files have uncommitted changes."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = done.stdout.strip() or "unknown"
    return commit + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user types it: `python -m benchmarks` and the arguments (this process's by default)."""
    return " ".join(["python -m benchmarks", *([shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])])


def shown_path(path: str | Path) -> str:
    """`path` as a record or a log shows it: relative to the checkout when inside it, else as given
    (the record refuses machine paths: `record.machine_paths`)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def run_meta(kind: str, command: str, gpu: str | None = None) -> dict:
    """The stamp every benchmark JSON carries under "meta": what ran (`kind`, the record's section;
    `command`), where (machine, CPU model and cores, GPU), at which commit and when (UTC)."""
    return {
        "kind": kind, "command": command,
        "machine": machine_description(gpu), "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "gpu": gpu,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def stamp(meta: dict) -> str:
    """The line that heads every table of a run: machine, command, commit and date of its "meta"."""
    return f"Machine: {meta['machine']}. Command: `{meta['command']}`. Commit {meta['commit']}, {meta['date']}."


def timed(run, seconds: float, warmup: int = 2, min_calls: int = 5) -> float:
    """Median seconds per call of `run()` over at least `seconds` and `min_calls` calls (noise-robust)."""
    for _ in range(warmup):
        run()
    samples, started = [], time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - started < seconds:
        begin = time.perf_counter()
        run()
        samples.append(time.perf_counter() - begin)
    return float(np.median(samples))


def parse_counts(text: str) -> list[int]:
    """`--streams 1,8,32` and the like: comma-separated integers >= 1."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1")
    return values


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(item) for item in value]
    return value


def record_json(run: dict) -> str:
    """A run's JSON as results and the record store it: one line per top-level key and per row of a
    list of rows, floats to 6 significant digits (more than any table shows)."""
    lines = []
    for key, value in _rounded(run).items():
        if isinstance(value, list) and value and all(isinstance(item, (dict, list)) for item in value):
            rows = ",\n".join(f"    {json.dumps(item)}" for item in value)
            lines.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_run(out_dir: Path, name: str, results: dict, table: str) -> None:
    """Print a run's table under its stamp and write it as OUT_DIR/NAME.md, its results as NAME.json."""
    text = f"{stamp(results['meta'])}\n\n{table}"
    print(text)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(text + "\n")
    (out_dir / f"{name}.json").write_text(record_json(results))
    print(f"wrote {out_dir / name}.md and .json", file=sys.stderr, flush=True)
