"""docs/benchmarks.md is generated: it is exactly what the committed runs in docs/benchmarks/ render,
every run in it is stamped, and the README's headline table is the record's. Also: the serving
flags are declared once, the GPU benchmark imports nothing beyond its own needs, and the benchmarks'
modules import neither tests/ nor each other in a cycle."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from benchmarks import record
from benchmarks.provenance import REPO_ROOT


def test_the_record_and_the_readme_headline_are_what_the_committed_runs_render():
    assert record.RECORD.read_text() == record.render_record(record.RECORD_DIR), (
        "docs/benchmarks.md is not what docs/benchmarks/*.json render: run `make record`, never edit it by hand")
    readme = record.README.read_text()
    assert record.with_headline(readme, record.headline(record.RECORD_DIR)) == readme, "stale headline: `make record`"
    # The headline block replaces only what lies between its markers.
    readme = f"# A\n\n## Performance\n\n{record.HEADLINE_BEGIN}\nold\n{record.HEADLINE_END}\n\nrest\n"
    assert record.with_headline(readme, "new") == readme.replace("\nold\n", "\nnew\n")
    with pytest.raises(record.RecordError, match="no <!-- benchmark-headline:begin -->"):
        record.with_headline("# no markers\n", "new")


def test_every_committed_run_is_stamped_named_by_its_kind_and_its_stamp_heads_its_section():
    runs = sorted(record.RECORD_DIR.glob("*.json"))
    assert {path.stem for path in runs} >= {"triton-python-ort", "triton-null"}, "the headline's runs are missing"
    for path in runs:
        run = record.read_run(path)
        meta = run["meta"]
        assert path.stem == meta["kind"]
        # What anyone can rerun from a clone: a committed tree, no folder of the machine it ran on.
        assert "uncommitted" not in meta["commit"] and not record.machine_paths(run), path
        assert all(meta[field] not in (None, "") for field in record.META_FIELDS), path
        assert isinstance(meta["cpu_cores"], int) and meta["cpu_model"] in meta["machine"]
    sections = record.RECORD.read_text().split("\n## ")[1:]
    assert len(sections) == len(runs) + (record.RECORD_DIR / record.RETIRED).read_text().count("\n## ") + 1
    for section in sections:
        title, _, body = section.partition("\n")
        # The stamp names the machine, the command, the commit and the date, before any table.
        stamps = re.findall(r"^Machine: .+\. Command: `.+`\. Commit \S+.*, \d{4}-\d\d-\d\d \d\d:\d\d UTC\.$", body, re.M)
        assert len(stamps) == 1, f"section {title!r} has {len(stamps)} stamps"
        first_table = body.find("\n|")
        assert first_table < 0 or body.find(stamps[0]) < first_table, f"section {title!r}: a table before the stamp"


def test_add_copies_a_committed_runs_in_and_rejects_unstamped_dirty_or_machine_bound_ones(tmp_path):
    run = json.loads(next(iter(sorted(record.RECORD_DIR.glob("*.json")))).read_text())
    fresh = tmp_path / "bench_results" / "run.json"
    fresh.parent.mkdir()

    def add(extra: dict | None = None, **meta):  # a meta value None removes that field
        meta = {key: value for key, value in {**run["meta"], "commit": "0000000", **meta}.items() if value is not None}
        fresh.write_text(json.dumps({**run, **(extra or {}), "meta": meta}))
        return record.add_run(fresh, tmp_path / "record")

    assert add() == tmp_path / "record" / f"{run['meta']['kind']}.json"
    assert "Commit 0000000," in record.render_record(tmp_path / "record")
    for extra, meta, error in [(None, {"commit": "0000000 (with uncommitted changes)"}, "uncommitted changes"),
                               (None, {"command": "python -m benchmarks memory --out-dir /tmp/x"},
                                "names machine paths \\(/tmp/x\\)"),
                               ({"export": "/tmp/mimi-export-1"}, {}, "names machine paths \\(/tmp/mimi-export-1\\)"),
                               (None, {"command": None}, "lacks command"),
                               (None, {"kind": "nonsense"}, "unknown kind 'nonsense'")]:
        with pytest.raises(record.RecordError, match=error):
            add(extra, **meta)


def test_render_and_bench_take_the_same_serving_flags():
    """One declaration (export.render) for `code2wav-export render` and `python -m benchmarks sweep`."""
    from benchmarks.__main__ import command_parser
    from mimi_code2wav.export.__main__ import build_parser as export_parser

    def serving(parser):
        group = next(g for g in parser._action_groups if g.title.startswith("serving"))
        return {(a.dest, a.default, a.type) for a in group._group_actions}

    render = next(a for a in export_parser()._actions if a.dest == "command").choices["render"]
    assert serving(render) == serving(command_parser("sweep"))
    args = command_parser("sweep").parse_args(["--front-instances", "2", "--max-queue-delay-us", "0"])
    assert (args.front_instances, args.max_queue_delay_us) == (2, 0)
    with pytest.raises(SystemExit):
        command_parser("sweep").parse_args(["--front-instances", "0"])


def test_the_gpu_benchmark_imports_only_its_own_needs():
    """It runs on a GPU machine with torch, numpy and onnx: importing it (as `python -m benchmarks gpu`
    does) loads neither tritonclient (the client package's modules it reaches are numpy only),
    onnxruntime, matplotlib nor another benchmark."""
    code = ("import sys, benchmarks.__main__ as m; m.command_parser('gpu'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tritonclient', 'onnxruntime', 'matplotlib', "
            "'torch', 'grpc') or m in ('benchmarks.sweep', 'benchmarks.record')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          cwd=REPO_ROOT)
    assert done.stdout.strip() == "[]"


def test_the_benchmarks_import_no_tests_and_no_cycle():
    """benchmarks/ is imported by the tests, never the other way, and its modules form no cycle."""
    imports = {}
    for path in (REPO_ROOT / "benchmarks").glob("*.py"):
        nodes = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))]
        found = {"." * getattr(node, "level", 0) + (getattr(node, "module", None) or alias.name)
                 for node in nodes for alias in node.names}
        assert not [name for name in found if name.split(".")[0] in ("tests", "helpers", "mimi_fixtures")], path
        imports[path.stem] = {name.lstrip(".").removeprefix("benchmarks.") for name in found
                              if name.startswith((".", "benchmarks."))}

    def reaches(start: str, target: str, seen: set) -> bool:
        return any(module == target or (module not in seen and reaches(module, target, seen | {module}))
                   for module in imports.get(start, ()))

    assert [module for module in imports if reaches(module, module, set())] == []


def test_a_sweep_stops_when_its_local_server_dies(tmp_path, monkeypatch):
    """The sweep does not start a dead server again: the point fails, the log's tail is recorded,
    perf_analyzer is not run against it, and the report says so."""
    from types import SimpleNamespace

    from benchmarks import sweep

    log = tmp_path / "tritonserver.log"
    log.write_text("Signal (11) received.\n")
    server = SimpleNamespace(grpc_url="127.0.0.1:1", log_path=log, is_alive=lambda: False, exit_code=lambda: -11,
                             pid=None, metrics_url=None)
    points = sweep.Sweep(tmp_path, frames=4, seed=0, point_seconds=1.0, server=server)
    monkeypatch.setattr(points, "client_point", lambda *_: {"requests": 3, "requests_per_s": 10.0})
    monkeypatch.setattr(points, "perf_point", lambda *_: pytest.fail("perf_analyzer ran against a dead server"))
    points.point(2, 1)
    assert points.client == [{"streams": 2, "chunk_frames": 1, "requests": 3, "requests_per_s": 10.0,
                              "error": "the server exited during the point"}]
    assert points.perf == [] and points.failures == 1
    assert points.server_exit.startswith("tritonserver exited during 2 stream(s), 1 frame(s) per request (code -11)")
    assert "Signal (11) received." in points.server_exit
    results = {"meta": {"server": "test", "frames": 4, "cpu_cores": 2, "server_exit": points.server_exit},
               "summary": {}, "client": points.client, "perf": [], "decoder_step_ms": {}}
    assert "the server exited during the run" in sweep.sweep_markdown(results)
