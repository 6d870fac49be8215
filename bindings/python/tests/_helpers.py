"""Shared helpers of kvferry's Python tests (stable: other test files import them).

- :data:`SPAWN`: the multiprocessing context every test uses. Once a process
  loaded libkvferry (it contains the Go runtime), ``fork`` may hang the child;
  "spawn" starts a fresh interpreter, which loads its own copy.
- :class:`Child`: a spawned process running ``target(conn, *args)`` with a
  pipe to the test. An exception in the child reaches the test as
  :class:`ChildFailed` with the child's traceback; a child that stops talking
  is a ``TimeoutError``, never a hang.
- :func:`pattern`, :func:`first_mismatch`, :func:`assert_bytes_equal`:
  deterministic data and byte-for-byte checks with a useful message.
- :func:`engine_pair`: two engines of this process on loopback tcp, the
  initiator holding the owner's segment open.
- :func:`pause` / :func:`resume`: SIGSTOP a peer and wait until every one
  of its threads is stopped (kill() returns before), then SIGCONT it.
- :func:`wait_until`: polls a condition, with a deadline.

Child targets must be importable functions at module level (spawn pickles
them by qualified name): define them in a test module or here.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from typing import Any, Callable, Iterator, List, Optional, Tuple

SPAWN = multiprocessing.get_context("spawn")

# How long a test waits for a child's message before failing: generous for a
# loaded 2-core machine, still far below any CI timeout.
CHILD_TIMEOUT = 60.0


class ChildFailed(AssertionError):
    """A spawned child raised (the message carries its traceback) or exited
    without the message the test expected."""


def _child_entry(conn: Any, target: Callable[..., None], args: Tuple[Any, ...]) -> None:
    """Runs target in the child; forwards any exception to the parent."""
    try:
        target(conn, *args)
    except BaseException:
        try:
            conn.send(("__error__", traceback.format_exc()))
        except Exception:
            pass
        conn.close()
        sys.exit(1)
    conn.close()


class Child:
    """A process started with "spawn" running ``target(conn, *args)``.

    Messages are tuples whose first item is a tag. Use as a context manager:
    on exit a child still alive is killed, so a failed test leaves no
    process behind."""

    def __init__(self, target: Callable[..., None], *args: Any, name: Optional[str] = None) -> None:
        self.name = name or target.__name__
        self.conn, child_conn = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_child_entry, args=(child_conn, target, args), name=self.name,
                                  daemon=True)
        self.proc.start()
        child_conn.close()  # so the parent sees EOF when the child dies

    def send(self, *msg: Any) -> None:
        """Sends a tuple (tag, ...) to the child."""
        self.conn.send(msg)

    def recv(self, timeout: float = CHILD_TIMEOUT) -> Tuple[Any, ...]:
        """The child's next message; ChildFailed if it raised or died,
        TimeoutError if it said nothing for ``timeout`` seconds."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"child {self.name}: no message in {timeout} s (alive: {self.proc.is_alive()})")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise ChildFailed(f"child {self.name} exited (code {self.proc.exitcode}) without a message") from None
        if isinstance(msg, tuple) and msg and msg[0] == "__error__":
            raise ChildFailed(f"child {self.name} raised:\n{msg[1]}")
        return msg

    def expect(self, tag: str, timeout: float = CHILD_TIMEOUT) -> Tuple[Any, ...]:
        """The payload of the child's next message, which must carry ``tag``."""
        msg = self.recv(timeout)
        if msg[0] != tag:
            raise ChildFailed(f"child {self.name}: got {msg[0]!r}, expected {tag!r}: {msg!r}")
        return msg[1:]

    def join(self, timeout: float = CHILD_TIMEOUT) -> None:
        """Waits for a clean exit (code 0); kills and fails otherwise."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            raise ChildFailed(f"child {self.name} still running after {timeout} s; killed")
        if self.proc.exitcode != 0:
            # A traceback may be waiting in the pipe.
            if self.conn.poll(0):
                self.recv(0)
            raise ChildFailed(f"child {self.name} exited with code {self.proc.exitcode}")

    def close(self) -> None:
        """Kills the child if it still runs and releases the pipe."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def child_expect(conn: Any, tag: str, timeout: float = CHILD_TIMEOUT) -> Tuple[Any, ...]:
    """In a child: the payload of the parent's next message, which must carry
    ``tag``; raises if the parent is silent for ``timeout`` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {tag!r} from the parent in {timeout} s")
    msg = conn.recv()
    if msg[0] != tag:
        raise AssertionError(f"got {msg!r} from the parent, expected {tag!r}")
    return msg[1:]


def pattern(seed: int, n: int) -> bytes:
    """n deterministic pseudo-random bytes; different seeds give different data."""
    return random.Random(seed).randbytes(n)


def first_mismatch(a: Any, b: Any) -> int:
    """Index of the first differing byte of two equal-length buffers, -1 if equal."""
    ma, mb = memoryview(a).cast("B"), memoryview(b).cast("B")
    if len(ma) != len(mb):
        return min(len(ma), len(mb))
    if ma == mb:
        return -1
    # Bisect on slices: comparisons run at C speed.
    lo, hi = 0, len(ma)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ma[lo:mid] != mb[lo:mid]:
            hi = mid
        else:
            lo = mid
    return lo


def assert_bytes_equal(got: Any, want: Any, what: str) -> None:
    """Byte-for-byte equality, naming the first differing offset."""
    i = first_mismatch(got, want)
    assert i < 0, f"{what}: first differing byte at offset {i} of {len(memoryview(want).cast('B'))}"


@contextlib.contextmanager
def engine_pair(**options: Any) -> Iterator[Tuple[Any, Any, Any]]:
    """(owner, initiator, segment): two engines of this process on loopback
    tcp, the initiator holding the owner's segment open. Options go to both."""
    import kvferry

    with kvferry.Engine(**options) as owner, kvferry.Engine(**options) as init:
        with init.open_segment(owner.name, timeout=10) as seg:
            yield owner, init, seg


def _task_states(pid: int) -> List[str]:
    """The scheduler state letter of every thread of pid (Linux /proc)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # the thread exited meanwhile
            pass
    return states


def pause(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOPs pid and returns once every one of its threads is stopped.

    kill() returns before the target stops: on a loaded machine its threads
    may run on for a while (long enough to answer a transfer), so a test
    that needs the peer silent waits for /proc to show every thread in
    state T."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: all(s in ("T", "t") for s in _task_states(pid)), timeout, f"process {pid} stopped")


def resume(pid: int) -> None:
    """SIGCONTs a process paused with :func:`pause`."""
    os.kill(pid, signal.SIGCONT)


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.001) -> None:
    """Polls cond until true; AssertionError after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {timeout} s")
        time.sleep(interval)
