"""Shared fixtures: the tiny model and real servers, with their logs printed when a test fails."""

from __future__ import annotations

import pytest

from mooncake_vllm.testing import servers
from mooncake_vllm.testing.tiny_model import build_tiny_model


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _failed(request) -> bool:
    return any(
        getattr(getattr(request.node, f"rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(build_tiny_model())


@pytest.fixture
def log_on_failure(request):
    """Register servers whose log tail is printed if the test fails: ``log_on_failure(srv)``."""
    watched: list = []
    yield watched.append
    if _failed(request):
        for srv in watched:
            proc = getattr(srv, "process", srv)
            print(f"\n===== log of {proc.name} ({proc.log_path}) =====\n{proc.log_tail()}")


@pytest.fixture(scope="module")
def module_servers(request):
    """Start servers for a module; stop them all at module end, printing logs if any test failed."""
    started: list = []

    def start(fn, *args, **kwargs):
        srv = fn(*args, **kwargs)
        started.append(srv)
        return srv

    yield start
    failed = request.session.testsfailed > 0
    for srv in reversed(started):
        if failed:
            proc = srv.process
            print(f"\n===== log of {proc.name} ({proc.log_path}) =====\n{proc.log_tail()}")
        srv.stop()


@pytest.fixture(autouse=True, scope="session")
def _no_process_left_behind():
    yield
    servers.stop_all()
