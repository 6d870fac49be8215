"""pytest setup of the kvferry Python tests; runs before any test module is
imported, which is what most of it relies on.

- Library: kvferry._lib loads libkvferry.so on first use, from
  $KVFERRY_LIBRARY. So KVFERRY_LIBRARY is chosen here, at import, before
  anything can load it: an explicit
  KVFERRY_LIBRARY wins (`make test-python` passes $(BUILD_DIR)/libkvferry.so),
  then the repository's build/libkvferry.so (`make lib`), then the copy in the
  package (`make python`). Spawned children inherit it with the environment.
  (Test modules must not put bindings/python on sys.path themselves: that
  would defeat KVFERRY_TEST_INSTALLED=1 below.)
- Import path: the in-tree package (bindings/python) goes first on sys.path,
  and spawned children get the parent's sys.path. KVFERRY_TEST_INSTALLED=1
  tests the installed package instead (a wheel, with its own library): neither
  sys.path nor KVFERRY_LIBRARY is touched then.
- Environment: inherited KVFERRY_* variables (other than KVFERRY_LIBRARY and
  KVFERRY_TEST_*) and MC_TRANSFER_TIMEOUT are removed from os.environ, so
  that a developer's shell (KVFERRY_PROTOCOL=rdma, a short
  KVFERRY_TIMEOUT_MS, ...) cannot change what spawned children and the
  Mooncake shim (which reads os.environ) see; KVFERRY_TEST_KEEP_ENV=1 keeps
  them. The Go runtime of this process cannot be helped here: it reads the
  environment the process was started with (exec), not os.environ, so
  scripts/run_tests.sh (`make test-python`) removes them before starting
  pytest, and the report header warns when they reached this process anyway.
  Tests that need such a variable set it in os.environ before spawning a
  child: a spawned child is a new exec, with os.environ as its environment.
- Fork rule: forking a process that loaded the library can hang the child
  (the Go runtime's threads do not survive fork). multiprocessing's default
  start method is set to "spawn" so that a test that forgets to ask for it
  is still safe; tests should ask for it anyway (the spawn_context fixture).
- Watchdog: a test running longer than KVFERRY_TEST_TIMEOUT seconds (default
  120; the whole suite takes well under a minute) ends the run with every
  thread's stack, after terminating the multiprocessing children, instead of
  hanging `make test`.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

PY_ROOT = Path(__file__).resolve().parent.parent  # bindings/python
REPO_ROOT = PY_ROOT.parent.parent
INSTALLED = os.environ.get("KVFERRY_TEST_INSTALLED") == "1"
TEST_TIMEOUT_S = float(os.environ.get("KVFERRY_TEST_TIMEOUT", "120"))


def _isolated(name: str) -> bool:
    """Whether an inherited variable would change what the tests see."""
    return ((name.startswith("KVFERRY_") and name != "KVFERRY_LIBRARY"
             and not name.startswith("KVFERRY_TEST_")) or name == "MC_TRANSFER_TIMEOUT")


def _exec_environment() -> List[str]:
    """Names of the variables this process was started with: what its Go
    runtime reads (/proc/self/environ), whatever os.environ says now."""
    try:
        with open("/proc/self/environ", "rb") as f:
            return [kv.split(b"=", 1)[0].decode(errors="replace") for kv in f.read().split(b"\0") if kv]
    except OSError:
        return []


# The environment is settled first: nothing below may load the library.
KEEP_ENV = os.environ.get("KVFERRY_TEST_KEEP_ENV") == "1"
if not KEEP_ENV:
    for _name in list(os.environ):
        if _isolated(_name):
            del os.environ[_name]
# Seen by this process's Go runtime even though removed from os.environ.
EXEC_LEAKS = [] if KEEP_ENV else sorted(n for n in _exec_environment() if _isolated(n))


def _default_library() -> Optional[Path]:
    """The library the in-tree tests use when KVFERRY_LIBRARY is not set."""
    for p in (REPO_ROOT / "build" / "libkvferry.so", PY_ROOT / "kvferry" / "libkvferry.so"):
        if p.exists():
            return p
    return None


if not INSTALLED:
    if not os.environ.get("KVFERRY_LIBRARY"):
        _lib_path = _default_library()
        if _lib_path is not None:
            os.environ["KVFERRY_LIBRARY"] = str(_lib_path)
        # Else kvferry._lib raises LibraryNotFound, listing where it looked.
    if str(PY_ROOT) not in sys.path:
        sys.path.insert(0, str(PY_ROOT))
else:
    # `python -m pytest` run from bindings/python puts it (as "" or its path)
    # on sys.path, and the source package would shadow the installed one;
    # PYTHONSAFEPATH (3.11+) does the same for `python -c` subprocesses.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != PY_ROOT]
    os.environ["PYTHONSAFEPATH"] = "1"

if "kvferry._lib" in sys.modules and getattr(sys.modules["kvferry._lib"], "_lib", None) is not None:
    # Something (a plugin, a sitecustomize) loaded the library before this
    # file could choose it: the environment above came too late for it.
    raise pytest.UsageError("libkvferry.so was loaded before tests/conftest.py set KVFERRY_LIBRARY")

# Spawn, not fork, whatever a test forgets to ask for (see the fork rule above).
multiprocessing.set_start_method("spawn", force=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """KVFERRY_TEST_INSTALLED=1: undoes a test module's own sys.path insert
    of bindings/python, made while it was collected, before any spawned child
    copies sys.path and would import the source package."""
    if INSTALLED:
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != PY_ROOT]


def pytest_report_header(config: pytest.Config) -> List[str]:
    """Which package and library the run uses (without loading the library:
    a test may check that importing kvferry alone does not)."""
    if INSTALLED:
        lines = ["kvferry: the installed package and its own library (KVFERRY_TEST_INSTALLED=1)"]
    else:
        lib = os.environ.get("KVFERRY_LIBRARY")
        where = f"{lib} -> {os.path.realpath(lib)}" if lib else "none found (build it with `make lib`)"
        lines = [f"kvferry: package {PY_ROOT / 'kvferry'}; library {where}"]
    if EXEC_LEAKS:
        lines.append(f"kvferry: WARNING: started with {', '.join(EXEC_LEAKS)}: removed for children, but this "
                     "process's Go runtime still sees them (run through `make test-python`, or unset them)")
    return lines


@pytest.fixture
def spawn_context() -> multiprocessing.context.SpawnContext:
    """multiprocessing with the "spawn" start method: the only safe one (with
    forkserver) in a process that loaded libkvferry.so."""
    return multiprocessing.get_context("spawn")


@pytest.fixture(scope="session")
def kvferry_library() -> Optional[str]:
    """Path of the libkvferry.so the in-tree tests load (None: the installed
    package's own, or none found)."""
    return None if INSTALLED else os.environ.get("KVFERRY_LIBRARY")


@pytest.fixture(autouse=True, scope="session")
def _reap_children() -> Iterator[None]:
    """Ends multiprocessing children a failed test left running, so the run
    can exit; tests join their own children."""
    yield
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


def _on_hang(config: pytest.Config, nodeid: str) -> None:
    """Runs on the watchdog thread when a test overran: report, reap, exit."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        # Captured output would be lost by os._exit: let this reach the terminal.
        capman.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n*** {nodeid} ran past {TEST_TIMEOUT_S:g} s (KVFERRY_TEST_TIMEOUT): "
                     "stacks of every thread, then exit\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for child in multiprocessing.active_children():
        child.kill()
    sys.stderr.flush()
    os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    """Arms the per-test watchdog around setup, call and teardown."""
    timer = threading.Timer(TEST_TIMEOUT_S, _on_hang, args=(item.config, item.nodeid))
    timer.daemon = True
    timer.start()
    # Backstop for a hang that keeps the watchdog thread from running (a
    # foreign call holding the GIL): faulthandler's own C thread exits.
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S + 30, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        timer.cancel()
