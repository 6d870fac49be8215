"""Child processes once libkvferry is loaded: spawn works, fork is refused.

Why not fork: libkvferry contains the Go runtime, which runs its own threads
(scheduler, garbage collector, network poller). fork() copies only the
calling thread, so in the child those threads are gone while their locks
and state are copied as they were: the first call into the library can hang
forever. On Linux, Python 3.11's multiprocessing defaults to "fork", so
kvferry users (and these tests) pick "spawn" (or "forkserver") explicitly:
the child is a fresh interpreter that loads its own copy of the library.

kvferry turns the hang into an error: in a child forked after the library
was loaded, every kvferry call raises kvferry.ForkError before it reaches
the library.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import warnings
from typing import Any, Tuple

import kvferry
from kvferry import _lib

from _helpers import SPAWN, Child, assert_bytes_equal, pattern

N = 256 * 1024


def _spawned_peer(conn: Any, parent: str, dst: int, src: int) -> None:
    """Runs in a spawned child: its own engine writes into the parent's
    memory and reads from it."""
    import kvferry

    with kvferry.Engine() as e, e.open_segment(parent, timeout=10) as seg:
        buf = e.alloc_buffer(2 * N)
        buf.write(pattern(2, N))
        e.write(seg, buf, dst, N, request_id=1, timeout=10)
        e.read(seg, buf.addr + N, src, N, request_id=2, timeout=10)
        conn.send(("done", buf.read(N, N) == pattern(3, N), os.getpid()))


def _pool_task(parent: str, src: int) -> Tuple[int, bytes]:
    """A ProcessPoolExecutor task (spawn context): reads the parent's memory."""
    import kvferry

    with kvferry.Engine() as e, e.open_segment(parent, timeout=10) as seg:
        buf = e.alloc_buffer(N)
        e.read(seg, buf, src, N, timeout=10)
        return os.getpid(), buf.read(16)


def test_spawn_works_after_the_library_is_loaded() -> None:
    with kvferry.Engine() as e:  # the library is loaded in this process now
        assert _lib._lib is not None
        dst = bytearray(N)
        src = e.alloc_buffer(N)
        src.write(pattern(3, N))
        dst_addr = e.register(dst)
        with Child(_spawned_peer, e.name, dst_addr, src.addr) as child:
            read_ok, pid = child.expect("done")
            child.join()
        assert pid != os.getpid()
        assert read_ok, "the spawned child's READ of our memory differs"
        assert_bytes_equal(dst, pattern(2, N), "the spawned child's WRITE into our memory")
        # The usual pool API works the same with the spawn context.
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=SPAWN) as pool:
            pid2, head = pool.submit(_pool_task, e.name, src.addr).result(timeout=60)
        assert pid2 != os.getpid() and head == pattern(3, N)[:16]


def test_a_forked_child_gets_fork_error_not_a_hang() -> None:
    with kvferry.Engine() as e:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; reports through its exit status only
            code = 1
            try:
                try:
                    e.stats()
                except kvferry.ForkError:
                    try:
                        kvferry.Engine()
                    except kvferry.ForkError as err:
                        code = 0 if "spawn" in str(err) else 2
            finally:
                os._exit(code)  # no atexit, no finalizers: nothing may call the library here
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung")
            time.sleep(0.01)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"forked child status {status:#x}"
        # The parent is unaffected.
        assert e.stats().registrations == 0
