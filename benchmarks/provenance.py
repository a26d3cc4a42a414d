"""What every benchmark shares: the stamp of its JSON, timing a call, markdown rows, writing a run.
Standard library and numpy only: `gpu` runs where only torch, numpy and onnx are."""

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


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo ('AMD EPYC ...'), else what `platform` knows."""
    with contextlib.suppress(OSError, StopIteration):
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    return platform.processor() or platform.machine()


def run_meta(kind: str, gpu: str | None = None, **fields) -> dict:
    """A run's "meta": its `kind` (the record's section), command, machine, commit (marked when dirty) and UTC date."""
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,  # noqa: E731
                                       timeout=10).stdout.strip()
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (git("rev-parse", "--short", "HEAD") or "unknown") + (
            " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
    return {
        "kind": kind, "command": " ".join(["python -m benchmarks", *map(shlex.quote, sys.argv[1:])]),
        "machine": f"{os.cpu_count()} CPU cores ({cpu_model()}), {gpu or 'no GPU'}, {platform.system()} {platform.release()}",
        "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "gpu": gpu, "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **fields,
    }


def stamp(meta: dict) -> str:
    """The line that heads every table of a run: machine, command, commit and date of its "meta"."""
    return f"Machine: {meta['machine']}. Command: `{meta['command']}`. Commit {meta['commit']}, {meta['date']}."


def md_row(*cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


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


def add_options(parser: argparse.ArgumentParser, *options: tuple) -> None:
    """Each (flag, default, help[, type]): typed as its default (a list: one or more of its items) unless given."""
    for flag, default, text, *kind in options:
        many = isinstance(default, list)
        parser.add_argument(flag, type=kind[0] if kind else type(default[0] if many else default), default=default,
                            nargs="+" if many else None, help=f"{text} (default %(default)s)")


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else value
    if isinstance(value, (dict, list, tuple)):
        return {k: _rounded(v) for k, v in value.items()} if isinstance(value, dict) else [_rounded(v) for v in value]
    return value


def record_json(run: dict) -> str:
    """A run's JSON: a line per top-level key and per row of a list, floats to 6 significant digits (more than shown)."""
    def entry(key, value) -> str:
        if isinstance(value, list) and value and all(isinstance(item, (dict, list)) for item in value):
            return f"  {json.dumps(key)}: [\n" + ",\n".join(f"    {json.dumps(item)}" for item in value) + "\n  ]"
        return f"  {json.dumps(key)}: {json.dumps(value)}"

    return "{\n" + ",\n".join(entry(key, value) for key, value in _rounded(run).items()) + "\n}\n"


def write_run(out_dir: Path, name: str, results: dict, table: str, title: str = "") -> None:
    """Print a run's table under its stamp (and `title`) and write it as OUT_DIR/NAME.md, its results as NAME.json."""
    text = f"{title}{stamp(results['meta'])}\n\n{table}"
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(text + "\n")
    (out_dir / f"{name}.json").write_text(record_json(results))
    log(f"wrote {out_dir / name}.md and .json")
