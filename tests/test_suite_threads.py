"""The suite's own background starts against pytest's temporary-directory factory (issue 53).

``tests/conftest.py`` starts the shared cluster in a thread while the first unit tests run.
pytest's ``TempPathFactory`` makes its base directory lazily and not thread-safely, so a thread
that calls ``mktemp`` while the main thread's first test asks for ``tmp_path`` can make a second
base directory, and every test on the cluster then errors at setup ("pd is not a normalized and
relative path": 274 errors on a fresh machine). The conftest now makes every directory a
background job writes to on the main thread. This module runs the real conftest in a pytest
subprocess with the factory's directory creation slowed, so that the race, when the code allows
it, happens every time instead of on some machines: it failed on the old conftest (the
cluster's fixture erred) and passes now.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNIT_TESTS = 20

# Loads the suite's real conftest under another name and takes all its hooks and fixtures; only
# what would start vLLM is replaced. The stub writes where the real start writes (the secret
# beside mooncake.json): given a factory, as the old conftest handed it, it calls ``mktemp``
# from its thread as the old ``_start_cluster`` did.
CONFTEST = """
import importlib.util, time
from pathlib import Path

import pytest
import _pytest.tmpdir as tmpdir

_make = tmpdir.make_numbered_dir_with_cleanup

def _slow_make(**kwargs):
    time.sleep(0.3)  # widens the window in which a second thread finds no base directory
    return _make(**kwargs)

tmpdir.make_numbered_dir_with_cleanup = _slow_make

spec = importlib.util.spec_from_file_location("suite_conftest", {conftest!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
globals().update({{k: v for k, v in vars(suite).items() if not k.startswith("__")}})


class FakeCluster:
    dump_logs = False
    servers = []

    def __init__(self, where):
        self.where = where

    def stop(self):
        pass


def _stub_start(model, tmp):
    where = tmp if isinstance(tmp, Path) else tmp.mktemp("pd")
    (where / "secret").write_text("not a secret")
    return FakeCluster(where)


suite._start_cluster = _stub_start


@pytest.fixture(scope="session")
def tiny_model():
    return "no-model"
"""

TESTS = """
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_unit(i, tmp_path):
    (tmp_path / "f").write_text(str(i))


@pytest.mark.servers
def test_on_the_cluster(cluster, tmp_path):
    assert (cluster.where / "secret").read_text() == "not a secret"
    assert cluster.where.parent == tmp_path.parent  # one base directory, not two
"""


def _run_suite(root: Path) -> subprocess.CompletedProcess:
    (root / "conftest.py").write_text(CONFTEST.format(conftest=str(REPO / "tests" / "conftest.py")))
    (root / "test_race.py").write_text(TESTS.format(n=UNIT_TESTS))
    temproot = root / "temproot"  # empty: the factory must make its base directory
    temproot.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DEBUG_TEMPROOT": str(temproot)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cluster_start_and_the_first_unit_tests_share_one_base_directory(tmp_path):
    for attempt in range(2):  # each a new session whose factory starts with no base directory
        root = tmp_path / f"run{attempt}"
        root.mkdir()
        run = _run_suite(root)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out
        assert f"{UNIT_TESTS + 1} passed" in out, out
        assert "error" not in out.lower(), out
        bases = sorted(p.name for p in (root / "temproot").glob("pytest-of-*/pytest-[0-9]*"))
        assert len(bases) == 1, bases  # the old conftest left two: one of them empty
