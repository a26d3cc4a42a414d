"""`python -m benchmarks record`: docs/benchmarks.md and the README's headline table, rendered from the
benchmark JSON kept in docs/benchmarks/ (one file per kind, the latest run of each), followed by
docs/benchmarks/retired.md as it is: the last rendering of investigations whose commands are gone.

    python -m benchmarks record                                      render docs/benchmarks.md and the README block
    python -m benchmarks record --add bench_results/bench.json ...   copy runs in (as docs/benchmarks/<kind>.json), render
    python -m benchmarks record --check                              exit 1 when either is not what the JSON renders

The record is generated, never edited by hand: tests/test_benchmark_record.py renders the committed
JSON and compares. Every section is one run, stamped with its machine, command, commit and date.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .decoder import decoder_markdown
from .duplex import duplex_markdown
from .failover import table as failover_markdown
from .front import front_markdown
from .gpu import gpu_markdown
from .memory import memory_markdown
from .provenance import REPO_ROOT, record_json, stamp
from .report import sweep_markdown

RECORD_DIR = REPO_ROOT / "docs" / "benchmarks"
RECORD = REPO_ROOT / "docs" / "benchmarks.md"
RETIRED = "retired.md"  # in the record's folder: sections kept as last rendered, their commands removed
README = REPO_ROOT / "README.md"
HEADLINE_BEGIN = "<!-- benchmark-headline:begin -->"
HEADLINE_END = "<!-- benchmark-headline:end -->"
META_FIELDS = ("kind", "machine", "cpu_model", "cpu_cores", "command", "commit", "date")


@dataclass(frozen=True)
class Section:
    kind: str  # meta["kind"] of the runs it shows, and the file name docs/benchmarks/<kind>.json
    title: str
    render: Callable[[dict], str]  # the run's JSON -> its markdown below the stamp
    command: str  # what produces such a run


def _sweep(results: dict) -> str:
    return sweep_markdown(results, heading="###")


# The decoder targets a local server runs, as their kinds and sections name them.
TARGETS = (("python-ort", "the python-ort decoder", ""),
           ("onnxruntime", "the native onnxruntime decoder", " --decoder onnxruntime"),
           ("null", "the null decoder (the front's ceiling)", " --decoder null"))


def _per_target(kind: str, title: str, render: Callable[[dict], str], command: str) -> list[Section]:
    """A benchmark's section for each decoder target, then for a running server (`-url`)."""
    return [*(Section(f"{kind}-{target}", f"{title}: {what}", render, f"{command}{flag}") for target, what, flag in TARGETS),
            Section(f"{kind}-url", f"{title}: a running server", render, f"{command} --url HOST:PORT")]


SECTIONS = (
    *_per_target("duplex", "The duplex tick", duplex_markdown, "python -m benchmarks duplex"),
    Section("decoder", "The decoder alone on a CPU", decoder_markdown, "python -m benchmarks decoder"),
    Section("gpu", "The decoder alone on a GPU", gpu_markdown, "python -m benchmarks gpu"),
    *_per_target("triton", "Through Triton", _sweep, "python -m benchmarks sweep"),
    Section("memory", "Server memory against live streams: the python-ort decoder", memory_markdown,
            "python -m benchmarks memory"),
    Section("memory-onnxruntime", "Server memory against live streams: the native onnxruntime decoder",
            memory_markdown, "python -m benchmarks memory --decoder onnxruntime"),
    Section("failover", "A replica killed under live streams", failover_markdown, "python -m benchmarks failover"),
    Section("front", "The front's cost per request, against the minimal BLS front", front_markdown,
            "python -m benchmarks front"),
)
KINDS = {section.kind: section for section in SECTIONS}


class RecordError(ValueError):
    pass


def read_run(path: Path) -> dict:
    """A benchmark JSON with a complete stamp of a known kind (raises RecordError)."""
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise RecordError(f"{path}: {error}") from None
    meta = run.get("meta") if isinstance(run, dict) else None
    missing = [field for field in META_FIELDS if not isinstance(meta, dict) or field not in meta]
    if missing:
        raise RecordError(f"{path}: its 'meta' lacks {', '.join(missing)} (a run of an older commit: run it again)")
    if meta["kind"] not in KINDS:
        raise RecordError(f"{path}: unknown kind {meta['kind']!r} (known: {', '.join(KINDS)})")
    return run


def _runs(directory: Path) -> dict[str, dict]:
    runs = {}
    for path in sorted(Path(directory).glob("*.json")):
        run = read_run(path)
        if path.stem != run["meta"]["kind"]:
            raise RecordError(f"{path}: holds a run of kind {run['meta']['kind']!r}; name it {run['meta']['kind']}.json")
        runs[path.stem] = run
    return runs


def render_record(directory: Path = RECORD_DIR) -> str:
    """docs/benchmarks.md from the runs in `directory`, then its retired.md (if any) as it is."""
    runs = _runs(directory)
    retired_path = Path(directory) / RETIRED
    retired = retired_path.read_text().rstrip("\n") if retired_path.is_file() else ""
    lines = [
        "# Benchmark record",
        "",
        "Generated by `python -m benchmarks record` (`make record`) from the JSON in [benchmarks/](benchmarks/): "
        "do not edit it by hand. Each section is the latest run of one benchmark, stamped with its machine, "
        "command, commit and date. To record a fresh run, give its JSON to "
        "`python -m benchmarks record --add bench_results/bench.json`: it replaces that benchmark's run and "
        "renders this file and the README's headline table again.",
        "",
    ]
    lines += [f"- [{section.title}](#{_anchor(section.title)})" for section in SECTIONS if section.kind in runs]
    lines += [f"- [{title}](#{_anchor(title)}) (retired: its command is gone)"
              for title in re.findall(r"^## (.+)$", retired, re.M)]
    absent = [section for section in SECTIONS if section.kind not in runs]
    if absent:
        lines += ["", "Not recorded yet: " + "; ".join(f"{s.title[0].lower()}{s.title[1:]} (`{s.command}`)" for s in absent) + "."]
    for section in SECTIONS:
        if section.kind in runs:
            run = runs[section.kind]
            lines += ["", f"## {section.title}", "", stamp(run["meta"]), "", section.render(run)]
    if retired:
        lines += ["", retired]
    return "\n".join(lines) + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, spaces to dashes, punctuation dropped."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _best_rate(run: dict) -> dict | None:
    """The point with the most requests/s, perf_analyzer's if it ran, else the client's."""
    for rows in (run["perf"], run["client"]):
        measured = [r for r in rows if "error" not in r]
        if measured:
            return max(measured, key=lambda r: r["requests_per_s"])
    return None


def headline(directory: Path = RECORD_DIR) -> str:
    """The README's performance table, for the python-ort, the native and the null decoder: the conversations a
    duplex pipeline can tick within the playout budget per policy (`duplex`), and requests/s through
    Triton (`sweep`), each run with its machine, command, commit and date."""
    runs = _runs(directory)
    lines = ["| decoder behind Triton | duplex conversations within budget: per-frame / ramp 1+5 / catch-up "
             "| requests/s (streams sending as fast as answered) |", "|---|---:|---:|"]
    stamps = []
    for decoder, name in (("python-ort", "python-ort"), ("onnxruntime", "onnxruntime (native)"),
                          ("null", "null (the front's ceiling)")):
        duplex, sweep = runs.get(f"duplex-{decoder}"), runs.get(f"triton-{decoder}")
        if duplex is None and sweep is None:
            continue
        most = duplex["most_conversations"] if duplex else {}
        ticks = " / ".join(str(most.get(policy, "-")) for policy in ("per-frame", "ramp 1+5", "catch-up"))
        if duplex:
            ticks += f" ({duplex['meta']['budget_ms']:g} ms)"
        best = _best_rate(sweep) if sweep else None
        rate = "-" if best is None else (f"{best['requests_per_s']:.0f} ({best['streams']} streams, "
                                         f"{best['chunk_frames']} frame(s) per request)")
        lines.append(f"| {name} | {ticks} | {rate} |")
        for run in (duplex, sweep):
            if run is not None:
                meta = run["meta"]
                stamps.append(f"- {meta['kind']}: {meta['machine']}; `{meta['command']}`; commit {meta['commit']}, "
                              f"{meta['date']}")
    if not stamps:
        return "No run through Triton is recorded yet: see [docs/benchmarks.md](docs/benchmarks.md)."
    return "\n".join([*lines, "", *stamps])


def with_headline(readme: str, table: str) -> str:
    """`readme` with `table` between the headline markers (raises RecordError without them)."""
    begin, end = readme.find(HEADLINE_BEGIN), readme.find(HEADLINE_END)
    if begin < 0 or end < begin:
        raise RecordError(f"the README has no {HEADLINE_BEGIN} ... {HEADLINE_END} block")
    return readme[: begin + len(HEADLINE_BEGIN)] + "\n" + table + "\n" + readme[end:]


def machine_paths(value) -> list[str]:
    """The absolute file paths in a run's strings (its command, the folders it names): a record shows
    none, since they mean nothing on another machine. A path counts when its top folder exists here
    (/tmp, /home, ...) or when it names the checkout."""
    if isinstance(value, dict):
        return [found for item in value.values() for found in machine_paths(item)]
    if isinstance(value, list):
        return [found for item in value for found in machine_paths(item)]
    if not isinstance(value, str):
        return []
    found = []
    for word in re.findall(r"(?:^|[\s=`'\"(])(/[^\s`'\")]+)", value):
        top = Path(*Path(word).parts[:2])
        if word.startswith(str(REPO_ROOT)) or (len(Path(word).parts) > 2 and top.is_dir()):
            found.append(word)
    return found


def add_run(path: Path, directory: Path = RECORD_DIR) -> Path:
    """Copy a run into `directory` as <kind>.json (replacing that kind's run); returns where. Only a
    run of a committed tree whose command names no absolute path goes in: the record is what anyone
    can rerun from a clone."""
    run = read_run(path)
    meta = run["meta"]
    if "uncommitted" in meta["commit"]:
        raise RecordError(f"{path}: ran on a tree with uncommitted changes ({meta['commit']}): commit, then run it again")
    absolute = machine_paths(run)
    if absolute:
        raise RecordError(f"{path}: it names machine paths ({', '.join(absolute)}): run it again with "
                          "paths inside the checkout, relative")
    target = Path(directory) / f"{run['meta']['kind']}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(record_json(run))
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--add", type=Path, nargs="+", default=[], metavar="JSON",
                        help="benchmark results to record (bench.json, memory.json, decoder.json, ...)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when docs/benchmarks.md or the README block is stale")


def run(args: argparse.Namespace) -> int:
    try:
        for path in args.add:
            print(f"recorded {path} as {add_run(path).relative_to(REPO_ROOT)}", file=sys.stderr)
        record, readme = render_record(), with_headline(README.read_text(), headline())
    except RecordError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    stale = [path for path, text in ((RECORD, record), (README, readme))
             if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO_ROOT)} is not what docs/benchmarks/ renders: run `make record`",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in ((RECORD, record), (README, readme)):
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}", file=sys.stderr)
    return 0
