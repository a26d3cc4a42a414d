"""Shared fixtures (session tritonservers on free ports, the Docker environment), the xdist work units, and the
running servers' log tails in a failing test's report."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import pytest

from benchmarks.docker_env import DockerUnavailable, docker_environment
from mimi_code2wav.server.processes import log_tail
from mimi_code2wav.server.supervise import running_server
from mimi_code2wav.server.triton import TritonServer

from helpers import REPO_ROOT

# Session-scoped Mimi fixtures (seeded checkpoints, references, exports) shared by every test module.
pytest_plugins = ("mimi_fixtures",)

_RUNNING: list[TritonServer] = []  # the factory's servers: their logs go into the report of a failing test


@pytest.fixture(scope="session")
def triton_server_factory():
    """`start(model_repository, **TritonServer kwargs)`: a ready server on free ports, stopped with the session.
    They stop in parallel: each may wait out the streams tests left open, and in series those waits add up."""
    with contextlib.ExitStack() as stack:

        def start(model_repository, **kwargs) -> TritonServer:
            server = stack.enter_context(running_server(model_repository, **kwargs))
            _RUNNING.append(server)
            stack.callback(_RUNNING.remove, server)
            return server

        try:
            yield start
        finally:
            if _RUNNING:
                with concurrent.futures.ThreadPoolExecutor(len(_RUNNING)) as pool:
                    list(pool.map(lambda server: server.stop(), _RUNNING))  # raises a stop's error
                # A Python stub that dies (serving or exiting) writes its threads' stacks to the server's log.
                died = [str(server.log_path) for server in _RUNNING
                        if server.log_path.exists() and "Fatal Python error" in server.log_path.read_text(errors="replace")]
                assert not died, f"a Python stub died; its stacks are in: {died}"


@pytest.fixture(scope="session")
def docker_env():
    """benchmarks/docker_env.py's environment for the README's `docker compose` commands, for the session.
    Without Docker the compose tests skip, saying why; in CI (CI=true) they fail."""
    try:
        with docker_environment(REPO_ROOT / "build" / "docker") as env:
            yield env
    except DockerUnavailable as error:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI runs the compose tests, and Docker is unavailable: {error}")
        pytest.skip(f"Docker is unavailable here: {error}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in _RUNNING:
            report.sections.append((f"tritonserver log tail ({server.log_path})", log_tail(server.log_path, lines=60)))


# `make test` runs two xdist workers. Each module is one work unit (its module servers start once), the Docker
# modules together one (one engine, images, ./bench_results); the longest units are queued first.
DOCKER_MODULES = ("test_compose", "test_compose_cpu", "test_compose_scale")
LONGEST_FIRST = ("docker", "test_serving", "test_failover", "test_readme", "test_export", "test_perf_inputs",
                 "test_server_launcher", "test_aio_client", "test_vllm_omni", "test_security")


def work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")
    return "docker" if module in DOCKER_MODULES else module


def pytest_collection_modifyitems(config, items):
    rank = {unit: n for n, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))  # stable: file order otherwise


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist runs without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)
