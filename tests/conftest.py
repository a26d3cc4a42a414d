"""Shared fixtures: real tritonserver instances on free loopback ports (`triton_server_factory`, session scope;
tests that must see a server stop use `server.supervise.running_server`), the Docker environment, and the xdist
work units. A failing test's report gets the log tails of the servers running at that moment.
"""

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
    """Callable `start(model_repository, **kwargs) -> TritonServer` (kwargs as `server.triton.TritonServer`'s):
    a ready server on free ports, stopped when the session ends. The servers stop together: each may wait for
    the streams tests left open (up to its exit timeout), and one after another those waits add up."""
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
                    for future in [pool.submit(server.stop) for server in _RUNNING]:
                        future.result()
                # Every Python model's stub writes its threads' stacks to the server's log if it dies
                # (model_lifecycle's fault handler), while serving or as it exits.
                died = [str(server.log_path) for server in _RUNNING
                        if server.log_path.exists() and "Fatal Python error" in server.log_path.read_text(errors="replace")]
                assert not died, f"a Python stub died; its stacks are in: {died}"


@pytest.fixture(scope="session")
def docker_env():
    """The environment for the README's `docker compose` commands here (benchmarks/docker_env.py: a Docker
    engine, Compose v2, stand-in images); the engine it started stops with the session. Without one
    the compose tests skip, saying why; in CI (CI=true) they fail."""
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


# `make test` runs the suite on two pytest-xdist workers. Each module is one unit of work, so that its
# module fixtures (servers) start once; the modules that use Docker are one, as they share one engine,
# the stand-in images and ./bench_results. The longest units are queued first, so that neither worker
# is left with one of them at the end.
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
