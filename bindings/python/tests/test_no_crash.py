"""Misuses from Python that must never crash the interpreter: huge lengths,
use after close or free, races with free, a fork. Each case runs in a child
interpreter (a crash there fails the test instead of killing pytest) with a
deadline, and must exit cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PY_ROOT = Path(__file__).resolve().parents[1]


def run_child(code: str, timeout: float = 60) -> str:
    """Runs code in a fresh interpreter that imports the in-tree package;
    fails on a crash, a hang or a non-zero exit, and returns its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PY_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)], env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung")
    assert p.returncode == 0, f"child exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def test_alloc_buffer_length_past_2_63_is_refused() -> None:
    """ctypes masks a size_t: 2**64 + 4096 used to map 4 KiB under a 2**64
    long Buffer, and reading it crashed."""
    run_child("""
        import kvferry, pytest
        with kvferry.Engine() as e:
            with pytest.raises(ValueError):
                e.alloc_buffer(2**64 + 4096)
    """)


def test_view_keeps_its_engine_alive() -> None:
    """A view of a buffer whose engine was dropped used to point at memory
    the garbage collector unmapped."""
    run_child("""
        import gc, kvferry
        v = kvferry.Engine().alloc_buffer(1 << 20).view()
        gc.collect()
        v[0] = 1
        assert v[0] == 1
    """)


def test_buffer_copy_racing_free_never_crashes() -> None:
    """Buffer.write releases the GIL in memmove; a free in another thread
    must wait for it rather than unmap the memory under it."""
    run_child("""
        import threading, kvferry
        with kvferry.Engine() as e:
            for _ in range(20):
                b = e.alloc_buffer(8 << 20)
                data = bytes(8 << 20)
                def loop():
                    try:
                        while True:
                            b.write(data)
                    except kvferry.KvferryError:
                        pass  # freed: refused, not a crash
                t = threading.Thread(target=loop)
                t.start()
                e.free_buffer(b)
                t.join()
    """)


def test_shim_raw_copies_after_close_and_racing_free() -> None:
    """The shim's raw copies used to touch managed buffers after close()
    unmapped them, and to race free_managed_buffer."""
    run_child("""
        import threading, pytest
        from kvferry.mooncake import TransferEngine
        t = TransferEngine()
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        for _ in range(20):
            a = t.allocate_managed_buffer(8 << 20)
            data = bytes(8 << 20)
            th = threading.Thread(target=lambda: [None for _ in iter(lambda: t.write_bytes_to_buffer(a, data, len(data)), -1)])
            th.start()
            assert t.free_managed_buffer(a, 8 << 20) == 0
            th.join()
        a = t.allocate_managed_buffer(1 << 20)
        t.close()
        with pytest.raises(RuntimeError):
            t.write_bytes_to_buffer(a, b"x" * 16, 16)
        with pytest.raises(RuntimeError):
            t.read_bytes_from_buffer(a, 16)
    """)


def test_shim_long_host_label_returns_a_code() -> None:
    """A host label too long for IDNA used to raise UnicodeError out of
    transfer calls, where Mooncake returns a code."""
    out = run_child("""
        from kvferry.mooncake import TransferEngine
        with TransferEngine() as t:
            assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            a = t.allocate_managed_buffer(1 << 20)
            print(t.transfer_sync_write("a" * 300 + ":1", a, a + 4096, 16))
    """)
    assert int(out.split()[-1]) < 0


def test_shim_engine_survives_a_forked_child() -> None:
    """A child forked after the shim's engine existed used to hang at exit
    (its finalizer called into the Go runtime, which does not survive fork);
    now it exits, and calls in it raise."""
    run_child("""
        import os, sys
        from kvferry.mooncake import TransferEngine
        t = TransferEngine()
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        pid = os.fork()
        if pid == 0:
            try:
                t.allocate_managed_buffer(4096)
                os._exit(3)  # should have raised
            except RuntimeError:
                sys.exit(0)  # runs finalizers: must not hang
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        t.close()
    """, timeout=30)


def test_indices_notify_data_and_poll_max_are_checked_before_the_library() -> None:
    """Values ctypes would wrap (indices past 2**64, negative ones) or
    misread (an int as notify data) are refused in Python."""
    run_child("""
        import kvferry, pytest
        with kvferry.Engine() as e:
            seg = e.open_segment(e.name)
            b = e.batch(1)
            for bad in (lambda: seg.buffer(2**64), lambda: e.batch(2**64 + 1), lambda: b.status(2**64),
                        lambda: b.status(-2**64), lambda: e.poll_events(0, 10**7)):
                with pytest.raises(ValueError):
                    bad()
            for data in (10, True):
                with pytest.raises(TypeError):
                    seg.notify(1, data)
            b.free()
    """)
