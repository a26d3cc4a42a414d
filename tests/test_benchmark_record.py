"""docs/benchmarks.md is generated: it is exactly what the committed runs in docs/benchmarks/ render,
every run in it is stamped, and the README's headline table is the record's. Also: the serving
flags are declared once, and the GPU benchmark imports nothing beyond its own needs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from benchmarks import record
from benchmarks.provenance import REPO_ROOT, stamp


def test_the_record_is_what_the_committed_runs_render():
    assert record.RECORD.read_text() == record.render_record(record.RECORD_DIR), (
        "docs/benchmarks.md is not what docs/benchmarks/*.json render: run `make record`, never edit it by hand")


def test_the_readme_headline_is_the_records():
    readme = record.README.read_text()
    block = re.search(re.escape(record.HEADLINE_BEGIN) + r"\n(.*?)\n" + re.escape(record.HEADLINE_END), readme, re.S)
    assert block, "README.md has no benchmark-headline block"
    assert block.group(1) == record.headline(record.RECORD_DIR), "the README's headline is stale: run `make record`"


def test_every_committed_run_is_stamped_and_named_by_its_kind():
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


def test_every_table_of_the_record_follows_its_runs_stamp():
    text = record.RECORD.read_text()
    sections = text.split("\n## ")[1:]
    assert len(sections) == len(list(record.RECORD_DIR.glob("*.json")))
    for section in sections:
        title, _, body = section.partition("\n")
        stamps = re.findall(r"^Machine: .+\. Command: `.+`\. Commit \S+.*, \d{4}-\d\d-\d\d \d\d:\d\d UTC\.$", body, re.M)
        assert len(stamps) == 1, f"section {title!r} has {len(stamps)} stamps"
        first_table = body.find("\n|")
        assert first_table < 0 or body.find(stamps[0]) < first_table, f"section {title!r}: a table before the stamp"


def test_add_copies_a_committed_runs_in_and_rejects_unstamped_dirty_or_machine_bound_ones(tmp_path):
    source = next(iter(sorted(record.RECORD_DIR.glob("*.json"))))
    run = json.loads(source.read_text())
    fresh = tmp_path / "bench_results" / "run.json"
    fresh.parent.mkdir()
    fresh.write_text(json.dumps({**run, "meta": {**run["meta"], "commit": "0000000"}}))
    target = record.add_run(fresh, tmp_path / "record")
    assert target == tmp_path / "record" / f"{run['meta']['kind']}.json"
    assert "Commit 0000000," in record.render_record(tmp_path / "record")

    fresh.write_text(json.dumps({**run, "meta": {**run["meta"], "commit": "0000000 (with uncommitted changes)"}}))
    with pytest.raises(record.RecordError, match="uncommitted changes"):
        record.add_run(fresh, tmp_path / "record")
    fresh.write_text(json.dumps({**run, "meta": {**run["meta"], "commit": "0000000",
                                                 "command": "python -m benchmarks memory --out-dir /tmp/x"}}))
    with pytest.raises(record.RecordError, match="names machine paths \\(/tmp/x\\)"):
        record.add_run(fresh, tmp_path / "record")
    fresh.write_text(json.dumps({**run, "meta": {**run["meta"], "commit": "0000000"}, "export": "/tmp/mimi-export-1"}))
    with pytest.raises(record.RecordError, match="names machine paths \\(/tmp/mimi-export-1\\)"):
        record.add_run(fresh, tmp_path / "record")

    del run["meta"]["command"]
    fresh.write_text(json.dumps(run))
    with pytest.raises(record.RecordError, match="lacks command"):
        record.add_run(fresh, tmp_path / "record")
    fresh.write_text(json.dumps({**run, "meta": {**run["meta"], "command": "x", "kind": "nonsense"}}))
    with pytest.raises(record.RecordError, match="unknown kind 'nonsense'"):
        record.add_run(fresh, tmp_path / "record")


def test_the_headline_block_replaces_only_what_lies_between_its_markers():
    readme = f"# A\n\n## Performance\n\n{record.HEADLINE_BEGIN}\nold\n{record.HEADLINE_END}\n\nrest\n"
    assert record.with_headline(readme, "new") == readme.replace("\nold\n", "\nnew\n")
    with pytest.raises(record.RecordError):
        record.with_headline("# no markers\n", "new")


def test_a_stamp_names_machine_command_commit_and_date():
    meta = {"machine": "2 CPU cores (X), no GPU, Linux 6", "command": "python -m benchmarks sweep", "commit": "abc1234",
            "date": "2026-01-02 03:04 UTC"}
    assert stamp(meta) == ("Machine: 2 CPU cores (X), no GPU, Linux 6. Command: `python -m benchmarks sweep`. "
                           "Commit abc1234, 2026-01-02 03:04 UTC.")


def test_render_and_bench_take_the_same_serving_flags():
    """One declaration (export.serving_flags) for `code2wav-export render` and `python -m benchmarks sweep`."""
    from benchmarks.__main__ import command_parser
    from mimi_code2wav.export.__main__ import build_parser as export_parser

    def serving_group(parser):
        group = next(g for g in parser._action_groups if g.title.startswith("serving"))
        return {(a.dest, a.default, a.type) for a in group._group_actions}

    def subcommand(parser, name):
        return next(a for a in parser._actions if a.dest == "command").choices[name]

    assert serving_group(subcommand(export_parser(), "render")) == serving_group(command_parser("sweep"))
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


def test_the_python_ort_benchmark_takes_out_one_mechanism_per_variant(onnx_fp32):
    """`python -m benchmarks python-ort` builds the model's core from the config render writes, and
    each variant really runs without its mechanism: without array reuse every output state is a new
    array, without feed-back every run gathers its inputs into arrays of their own, without IO binding
    ONNX Runtime allocates the outputs (none come from the core's arrays)."""
    from benchmarks.python_ort import Bench

    bench = Bench(onnx_fp32, streams=2, threads=2)
    assert bench.config.max_live_streams == 2 and bench.config.max_rows_per_run == 8
    counts = {}
    for variant in ("as served", "no array reuse", "no feed-back", "no IO binding", "plain"):
        with bench.variant(variant) as core:
            name = bench.config.inputs[0].name
            for step in range(4):
                core.step([bench.core_module.StepRequest(sid, step == 0, False, {name: bench.codes[step]})
                           for sid in (1, 2)])
                if step == 1:
                    before = (core.buffers.allocated_total, core.buffers.reused_total)
            counts[variant] = (core.buffers.allocated_total - before[0], core.buffers.reused_total - before[1])
    # Two warm runs of the same two streams, each with one array per state: as served each run's
    # output states reuse the arrays the run before last let go, and its inputs are fed back as they are.
    states = len(bench.config.states)
    assert counts == {"as served": (0, 2 * states), "no array reuse": (2 * states, 0),
                      "no feed-back": (0, 2 * 2 * states), "no IO binding": (0, 0), "plain": (0, 0)}, counts
    assert bench.core_module.reuse_order is not None and bench.ms_per_run("as served", "together", 1, 0) > 0
