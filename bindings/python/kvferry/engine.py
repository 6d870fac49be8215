"""The Pythonic API of kvferry: :class:`Engine`, :class:`Segment`,
:class:`Batch`, requests, safe abort, fences by memory range, grants,
notifications, events, stats.

Conventions:

- Timeouts are seconds (int or float). ``None`` means the engine's default
  timeout (``default_timeout_ms``, 30 s unless configured); nothing waits
  forever. They are rounded up to whole milliseconds.
- A failed call raises a :class:`kvferry.KvferryError` subclass chosen by the
  library's status code (``.code``), with the library's message (``.message``,
  which names the call and the cause). Python-side argument errors are plain
  ``TypeError``/``ValueError``; the library's own ``KVF_ERR_INVALID`` is
  :class:`InvalidArgumentError`, which is a ``ValueError`` too.
- Each call crosses into the library once: a batch of requests is packed into
  one C array (with :mod:`array`, at C speed for the column forms) and
  submitted with one call. ctypes releases the GIL during every call, so
  blocking calls (transfers, waits, aborts, polls) let other threads run.
- Fork: the library contains the Go runtime, whose threads do not survive
  ``fork()``. Once the library is loaded (the first :class:`Engine`), start
  child processes with ``multiprocessing``'s "spawn" or "forkserver" method
  (or fork+exec). A forked child that calls kvferry gets :class:`ForkError`
  instead of a hang.
"""

from __future__ import annotations

import ctypes
import enum
import math
import os
import struct
import sys
import threading
import weakref
from array import array
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _lib
from ._lib import KvferryError
from ._memory import MemoryInfo, _as_int, _is_ndarray, _is_tensor, check_range, is_int_like, memory_info

__all__ = [
    "AbortResult", "AbortedError", "BatchFullError", "Batch", "Buffer", "BusyError", "CanceledError",
    "ConnectionBrokenError", "Engine", "EngineClosedError", "Event", "EventType", "FenceResult", "FencedError",
    "ForkError", "HandleError",
    "InternalError", "InvalidArgumentError", "KvferryError", "NoMemoryError", "NotRegisteredError", "Op",
    "OverlapError", "ProtocolError", "RefusedError", "RemoteRangeError", "Request", "Segment", "StaleKeyError",
    "Stats", "TaskState", "TaskStatus", "TimedOutError", "TransferFailedError", "TruncatedError", "MemoryInUseError",
    "UnauthenticatedError", "UnreachableError", "UnsupportedError", "UnknownStatusError", "error_for", "library_version",
]

_MAX_U64 = (1 << 64) - 1
_MAX_I32 = (1 << 31) - 1


# --------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------

class Op(enum.IntEnum):
    """kvf_op: the header's values (KVF_OP_READ = 0, KVF_OP_WRITE = 1)."""

    READ = 0   #: copy the segment's memory into ours
    WRITE = 1  #: copy our memory into the segment's


# The request packer relies on these values (ops are checked as <= 1).
assert (_lib.OP_READ, _lib.OP_WRITE) == (Op.READ, Op.WRITE), "kvferry._lib op values differ from kvferry.h"


class TaskState(enum.IntEnum):
    """kvf_task_state: WAITING and PENDING are in flight, the rest final."""

    WAITING = 0
    PENDING = 1
    COMPLETED = 2
    FAILED = 3
    TIMEOUT = 4
    CANCELED = 5
    ABORTED = 6

    @property
    def final(self) -> bool:
        """Whether the task has ended (the engine no longer touches its memory)."""
        return self >= TaskState.COMPLETED


class EventType(enum.IntEnum):
    """kvf_event_type."""

    NONE = 0
    ABORTED = 1   #: an owner aborted request_id below generation; our transfers of it end ABORTED
    NOTIFY = 2    #: a peer's notification (Segment.notify)
    CANCELED = 3  #: an initiator of request_id gave up on it (deadline or cancel); best effort


# Lookup tables: building an IntEnum member per task is the costly part of
# converting a thousand statuses, a tuple index is not.
_STATES: Tuple[TaskState, ...] = tuple(TaskState)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

class _Picklable:
    """Lets errors cross process boundaries (multiprocessing pickles them):
    KvferryError's constructor takes (code, message), not its str."""

    code: int
    message: str

    def __reduce__(self) -> Any:
        return (type(self), (self.code, self.message), dict(self.__dict__))


class UnknownStatusError(_Picklable, KvferryError):
    """A status code this binding does not know (a newer library)."""


class InvalidArgumentError(_Picklable, KvferryError, ValueError):
    """KVF_ERR_INVALID: the library rejected an argument (zero length,
    address in the first page, bad index, ...)."""


class HandleError(_Picklable, KvferryError):
    """KVF_ERR_HANDLE: a stale (closed, freed, destroyed engine's) handle, or
    a handle of another engine."""


class OverlapError(_Picklable, KvferryError, ValueError):
    """KVF_ERR_OVERLAP: the range overlaps a registered range."""


class NotRegisteredError(_Picklable, KvferryError):
    """KVF_ERR_NOT_REGISTERED: local memory (or, on the engine's own
    segment, the target range) is not registered."""


class RemoteRangeError(_Picklable, KvferryError):
    """KVF_ERR_REMOTE_RANGE: the peer has not registered the remote range."""


class StaleKeyError(_Picklable, KvferryError):
    """KVF_ERR_STALE_KEY: the range was unregistered since the request was planned."""


class RefusedError(_Picklable, KvferryError):
    """KVF_ERR_REFUSED: the owner of the memory refused the access (grants)."""


class TimedOutError(_Picklable, KvferryError, TimeoutError):
    """KVF_ERR_TIMEOUT: a deadline passed. Also a builtin ``TimeoutError``."""


class CanceledError(_Picklable, KvferryError):
    """KVF_ERR_CANCELED: canceled by the caller or by the engine's close."""


class ConnectionBrokenError(_Picklable, KvferryError, ConnectionError):
    """KVF_ERR_CONNECTION: a data connection broke (after retries)."""


class UnreachableError(_Picklable, KvferryError, ConnectionError):
    """KVF_ERR_UNREACHABLE: the peer did not answer in time, or was declared dead."""


class BusyError(_Picklable, KvferryError):
    """KVF_ERR_BUSY: a batch still has tasks in flight, or (notify) the
    peer's event queue is full: retry later."""


class BatchFullError(_Picklable, KvferryError):
    """KVF_ERR_BATCH_FULL: more requests than the batch's capacity."""


class EngineClosedError(_Picklable, KvferryError):
    """KVF_ERR_CLOSED: the engine is closed (or being destroyed)."""


class UnsupportedError(_Picklable, KvferryError):
    """KVF_ERR_UNSUPPORTED: not supported here (e.g. "cuda:N" memory without a CUDA driver)."""


class TransferFailedError(_Picklable, KvferryError):
    """KVF_ERR_TRANSFER_FAILED: a transfer failed for another reason."""


class NoMemoryError(_Picklable, KvferryError):
    """KVF_ERR_NO_MEMORY: out of memory."""


class InternalError(_Picklable, KvferryError):
    """KVF_ERR_INTERNAL: a bug in kvferry; the message says where."""


class AbortedError(_Picklable, KvferryError):
    """KVF_ERR_ABORTED: the owner aborted the request id."""


class ProtocolError(_Picklable, KvferryError):
    """KVF_ERR_PROTOCOL: a peer sent a malformed or unexpected message."""


class TruncatedError(_Picklable, KvferryError):
    """KVF_ERR_TRUNCATED: an output buffer was too small."""


class FencedError(RefusedError):
    """KVF_ERR_FENCED: the owner fenced a range the transfer touches
    (:meth:`Engine.fence`) after the transfer was planned. Final for that
    transfer, never retried; a transfer planned now passes. A
    :class:`RefusedError` too."""


class UnauthenticatedError(_Picklable, KvferryError):
    """KVF_ERR_UNAUTHENTICATED: with authentication on, the peer did not
    prove a key our allowlist holds, or refused ours; nothing was sent to
    it."""


class MemoryInUseError(_Picklable, KvferryError):
    """KVF_ERR_IN_USE: the engine could not confirm in time that it stopped
    touching a transfer's memory (a NIC neither completed nor flushed its
    work). Do not reuse that memory; its tasks stay in flight."""


class ForkError(RuntimeError):
    """kvferry was called in a child forked after the library was loaded.

    The Go runtime's threads do not exist in such a child and a call could
    hang: start children with multiprocessing's "spawn" or "forkserver"."""


_ERRORS = {
    _lib.ERR_INVALID: InvalidArgumentError,
    _lib.ERR_HANDLE: HandleError,
    _lib.ERR_OVERLAP: OverlapError,
    _lib.ERR_NOT_REGISTERED: NotRegisteredError,
    _lib.ERR_REMOTE_RANGE: RemoteRangeError,
    _lib.ERR_STALE_KEY: StaleKeyError,
    _lib.ERR_REFUSED: RefusedError,
    _lib.ERR_TIMEOUT: TimedOutError,
    _lib.ERR_CANCELED: CanceledError,
    _lib.ERR_CONNECTION: ConnectionBrokenError,
    _lib.ERR_UNREACHABLE: UnreachableError,
    _lib.ERR_BUSY: BusyError,
    _lib.ERR_BATCH_FULL: BatchFullError,
    _lib.ERR_CLOSED: EngineClosedError,
    _lib.ERR_UNSUPPORTED: UnsupportedError,
    _lib.ERR_TRANSFER_FAILED: TransferFailedError,
    _lib.ERR_NO_MEMORY: NoMemoryError,
    _lib.ERR_INTERNAL: InternalError,
    _lib.ERR_ABORTED: AbortedError,
    _lib.ERR_PROTOCOL: ProtocolError,
    _lib.ERR_TRUNCATED: TruncatedError,
    _lib.ERR_IN_USE: MemoryInUseError,
    _lib.ERR_FENCED: FencedError,
    _lib.ERR_UNAUTHENTICATED: UnauthenticatedError,
}


def error_for(code: int, message: str) -> KvferryError:
    """The exception for a status code: the KvferryError subclass of that
    code (UnknownStatusError for codes this binding does not know)."""
    return _ERRORS.get(code, UnknownStatusError)(code, message)


# --------------------------------------------------------------------------
# Library access, fork guard, checks
# --------------------------------------------------------------------------

_forked_after_load = False


def _after_fork_in_child() -> None:
    # Only a child forked after the library was loaded is poisoned: the Go
    # runtime's threads were not copied and its locks may be held.
    global _forked_after_load
    if _lib._lib is not None:
        _forked_after_load = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _L() -> ctypes.CDLL:
    """The library, loading it on first use; ForkError in a forked child."""
    if _forked_after_load:
        raise ForkError(
            "kvferry: this process was forked after libkvferry was loaded; the Go runtime does not survive "
            "fork(). Start child processes with multiprocessing's 'spawn' or 'forkserver' start method "
            "(multiprocessing.get_context('spawn')), or fork+exec.")
    return _lib.lib()


def _last_error(lib: ctypes.CDLL) -> str:
    return lib.kvf_last_error().decode(errors="replace")


def _check(lib: ctypes.CDLL, code: int) -> None:
    """Raises the code's exception with this thread's last-error message.

    Must run on the thread that made the call, right after it: ctypes calls
    run on the calling OS thread, and the message is per thread."""
    if code != _lib.OK:
        raise error_for(code, _last_error(lib))


def _read_string(lib: ctypes.CDLL, fn: Any, handle: int) -> str:
    """Calls a kvf_*_name-style function (handle, buf, cap, len_out)."""
    n = c_size_t(0)
    buf = ctypes.create_string_buffer(128)
    code = fn(handle, buf, len(buf), byref(n))
    if code == _lib.ERR_TRUNCATED:
        buf = ctypes.create_string_buffer(n.value + 1)
        code = fn(handle, buf, len(buf), byref(n))
    _check(lib, code)
    return buf.value.decode()


def _timeout_ms(timeout: Optional[float], *, allow_zero: bool) -> int:
    """Seconds to the library's milliseconds; None is KVF_TIMEOUT_DEFAULT.

    Rounds up so that a positive timeout never becomes 0 ("do not wait")."""
    if timeout is None:
        return _lib.TIMEOUT_DEFAULT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout {timeout}: must be >= 0 seconds (None: the engine's default)")
    if math.isinf(timeout):
        raise ValueError("timeout inf: nothing waits forever in kvferry; pass None for the engine's default")
    ms = math.ceil(timeout * 1000)
    if ms == 0 and not allow_zero:
        raise ValueError("timeout 0: this call needs a deadline > 0 (None: the engine's default)")
    if ms > _MAX_I32:
        raise ValueError(f"timeout {timeout} s is longer than the library accepts ({_MAX_I32} ms)")
    return ms


def _u64(value: Any, what: str) -> int:
    v = _as_int(value, what)
    if not 0 <= v <= _MAX_U64:
        raise ValueError(f"{what} {v}: must be in [0, 2**64)")
    return v


def _index(value: Any, what: str = "index") -> int:
    """An index or count for a size_t argument: ctypes would wrap anything
    outside [0, 2**63) silently into another, valid-looking one."""
    v = _as_int(value, what)
    if not 0 <= v < 1 << 63:
        raise ValueError(f"{what} {v}: must be in [0, 2**63)")
    return v


def library_version() -> str:
    """The loaded library's version string ("0.4.0"); loads it if needed."""
    return _L().kvf_version_string().decode()


def _alive(pid: int) -> bool:
    """Whether a finalizer may call the library: same process, not a fork."""
    return os.getpid() == pid and not _forked_after_load and _lib._lib is not None


# --------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------

class TaskStatus(NamedTuple):
    """The state of one task: ``state``, ``error`` (a status code: why a
    final task did not complete; 0 otherwise) and ``transferred`` (bytes
    confirmed moved; a lower bound if it failed)."""

    state: TaskState
    error: int
    transferred: int

    @property
    def ok(self) -> bool:
        """Whether the task COMPLETED."""
        return self.state == TaskState.COMPLETED

    @property
    def final(self) -> bool:
        """Whether the task has ended."""
        return self.state >= TaskState.COMPLETED


# kvf_task_status as packed in memory: int32 state, int32 error, uint64 transferred.
_STATUS_STRUCT = struct.Struct("=iiQ")
_WORDS = struct.Struct("=QQ")


def _status(state: int, error: int, transferred: int) -> TaskStatus:
    st = _STATES[state] if 0 <= state < len(_STATES) else state
    return TaskStatus(st, error, transferred)  # type: ignore[arg-type]


def _statuses(out: Any, n: int) -> List[TaskStatus]:
    """Converts n kvf_task_status of a ctypes array into TaskStatus tuples.

    A batch's statuses repeat (COMPLETED, 0, page size): each distinct one is
    built once and shared (they are immutable), and the rest runs at C speed
    (~170 ns per task on the 2-core dev box, against ~500 for building each)."""
    words = memoryview((ctypes.c_char * (n * _STATUS_STRUCT.size)).from_buffer(out)).cast("B").cast("Q")
    pairs = list(zip(words[0::2].tolist(), words[1::2].tolist()))
    built = {}
    for p in set(pairs):
        built[p] = _status(*_STATUS_STRUCT.unpack(_WORDS.pack(*p)))
    return list(map(built.__getitem__, pairs))


class Request(NamedTuple):
    """One transfer: ``length`` bytes between our registered memory at
    ``local`` (an int address or a :class:`Buffer`) and the segment's
    registered memory at ``remote``. ``request_id`` is the application's id
    (0: none); aborts act per request id. A NamedTuple (cheap to build by the
    thousand); a plain tuple ``(op, local, segment, remote, length[,
    request_id])`` is accepted wherever a Request is."""

    op: Op
    local: int
    segment: "Segment"
    remote: int
    length: int
    request_id: int = 0


RequestLike = Union[Request, Tuple[Any, ...]]

_OP_TYPES = {Op, int}


@dataclass(frozen=True)
class AbortResult:
    """Outcome of :meth:`Engine.abort`.

    ``safe``: no further byte of the request can touch our memory (reuse it
    at once). ``generation``: the request id's generation after the abort.
    ``bytes_confirmed``: a lower bound of the bytes that landed, from the
    ACKs received in time. ``reason``: why it is not safe ("" when safe),
    ``code`` the matching status code (0 when safe). NotSafe is a result,
    not an exception."""

    safe: bool
    generation: int
    bytes_confirmed: int
    reason: str = ""
    code: int = 0


@dataclass(frozen=True)
class FenceResult:
    """Outcome of :meth:`Engine.fence`.

    ``safe``: no transfer planned before the fence, whatever its request id
    (0 included) and initiator, can write into or read from the ranges any
    more (reuse them at once). ``epoch``: the fence's epoch; transfers
    planned from now on carry it and pass. ``peers_told``: peers sent the
    fence notice (those that fetched our descriptor lately, rdma
    initiators); ``peers_acked``: those that acknowledged it by the return;
    ``peers_cut``: rdma initiators whose QPs to us were moved to the error
    state. ``reason``: why it is not safe ("" when safe), ``code`` the
    matching status code (0 when safe). NotSafe is a result, not an
    exception."""

    safe: bool
    epoch: int
    peers_told: int
    peers_acked: int
    peers_cut: int
    reason: str = ""
    code: int = 0


@dataclass(frozen=True)
class Event:
    """An event from :meth:`Engine.poll_events`: its ``type`` (an
    :class:`EventType`, or an int for types newer than this binding), the
    ``peer``'s segment name, ``request_id``, ``generation`` (ABORTED events)
    and ``data`` (NOTIFY events, at most 64 bytes)."""

    type: Union[EventType, int]
    peer: str
    request_id: int
    generation: int
    data: bytes


@dataclass(frozen=True)
class Stats:
    """A snapshot of an engine's counters (kvf_stats)."""

    bytes_written: int      #: bytes of completed WRITE tasks we initiated
    bytes_read: int         #: bytes of completed READ tasks we initiated
    tasks_completed: int
    tasks_failed: int       #: FAILED, TIMEOUT and ABORTED tasks
    tasks_canceled: int
    tasks_in_flight: int
    retries: int            #: slices posted again after a broken path
    owner_bytes_in: int     #: bytes peers wrote into our memory
    owner_bytes_out: int    #: bytes peers read from our memory
    owner_refused: int      #: peer accesses we refused
    refused_in_flight: int  #: refusals that struck mid-slice
    protocol_errors: int
    control_dropped: int
    control_late: int
    registrations: int      #: registered ranges
    open_segments: int
    aborts_safe: int
    aborts_not_safe: int
    abort_acks: int
    acks_unmatched: int
    aborts_received: int
    tasks_aborted: int
    tombstones: int
    events_dropped: int
    fences_safe: int           #: fence calls that reported safe
    fences_not_safe: int       #: fence calls that did not
    fence_epoch: int           #: the last fence's epoch (0: none yet)
    fence_refused: int         #: accesses refused as planned before a fence
    fence_acks: int            #: fence notices acknowledged by the peers told
    fence_acks_unmatched: int  #: acknowledgements dropped: late, duplicate, unknown
    fences_received: int       #: fence notices received from owners we transfer with
    auth_refused: int = 0      #: peers refused for authentication, or cut when their key left the allowlist


_STATS_FIELDS = tuple(Stats.__dataclass_fields__)


# --------------------------------------------------------------------------
# Request packing
# --------------------------------------------------------------------------

# kvf_request is six 64-bit words: (op | flags << 32), local, segment,
# remote, length, request_id. Packing columns into an array('Q') with slice
# assignments runs at C speed; the ctypes array is then a view of it.
_REQ_WORDS = 6
_FAST_PACK = sys.byteorder == "little" and ctypes.sizeof(_lib.Request) == 8 * _REQ_WORDS
assert ctypes.sizeof(_lib.TaskStatus) == _STATUS_STRUCT.size


def _is_scalar(value: Any) -> bool:
    """One address or number for every request (an int, int-like or Buffer)
    rather than a column."""
    return isinstance(value, Buffer) or is_int_like(value)


def _column(values: Any, n: int, what: str) -> array:
    """A column of n uint64 values from a sequence (or one int for all)."""
    if isinstance(values, array) and values.typecode == "Q":
        col = values
    elif _is_scalar(values):
        return array("Q", [_u64(values, what)]) * n
    else:
        try:
            col = array("Q", values)
        except TypeError as e:
            raise TypeError(f"{what}: {e}") from None
        except OverflowError:
            raise ValueError(f"{what}: every value must be in [0, 2**64)") from None
    if len(col) != n:
        raise ValueError(f"{what}: {len(col)} values for {n} requests")
    return col


def _pack(n: int, ops: array, local: array, segs: array, remote: array, length: array,
          rids: array) -> Any:
    """A ctypes array of n kvf_request from six uint64 columns."""
    if _FAST_PACK:
        words = array("Q", bytes(8 * _REQ_WORDS * n))
        words[0::6] = ops
        words[1::6] = local
        words[2::6] = segs
        words[3::6] = remote
        words[4::6] = length
        words[5::6] = rids
        return (_lib.Request * n).from_buffer(words)
    reqs = (_lib.Request * n)()  # big-endian or unusual ABI: field by field
    for i in range(n):
        r = reqs[i]
        r.op, r.local, r.segment = ops[i], local[i], segs[i]
        r.remote, r.length, r.request_id = remote[i], length[i], rids[i]
    return reqs


def _op(op: Any) -> int:
    """The kvf_op value of an Op (or its int value)."""
    if isinstance(op, Op):
        return int(op)
    if isinstance(op, bool) or not isinstance(op, int):
        raise TypeError(f"op must be kvferry.Op.READ or Op.WRITE, not {type(op).__name__}")
    try:
        return int(Op(op))
    except ValueError:
        raise ValueError(f"op {op}: want Op.READ (0) or Op.WRITE (1)") from None


# --------------------------------------------------------------------------
# Buffer
# --------------------------------------------------------------------------

class Buffer:
    """Memory from :meth:`Engine.alloc_buffer`: mapped and registered by
    the engine, zero-filled, owned by it. Use it as an address (``int(buf)``,
    or as ``local`` of a request); read and write it with :meth:`read` and
    :meth:`write`, which refuse to touch it once it was freed."""

    __slots__ = ("addr", "length", "location", "_engine", "_freed", "__weakref__")

    def __init__(self, engine: "Engine", addr: int, length: int, location: str) -> None:
        self.addr = addr
        self.length = length
        self.location = location
        self._engine = engine
        self._freed = False

    def __index__(self) -> int:
        return self.addr

    def __int__(self) -> int:
        return self.addr

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"<kvferry.Buffer {self.addr:#x} +{self.length} {self.location}{state}>"

    @property
    def freed(self) -> bool:
        """Whether the memory was freed (by free_buffer or the engine's close)."""
        return self._freed or self._engine.closed

    def _span(self, offset: int, n: int) -> int:
        if self.freed:
            raise EngineClosedError(_lib.ERR_CLOSED, f"kvferry.Buffer {self.addr:#x}: the buffer was freed")
        offset = _as_int(offset, "offset")
        if offset < 0 or n < 0 or offset + n > self.length:
            raise ValueError(f"[{offset}, +{n}) is outside the buffer's {self.length} bytes")
        return self.addr + offset

    def write(self, data: Any, offset: int = 0) -> None:
        """Copies a bytes-like object into the buffer at offset."""
        # The check and the copy hold the engine's memory lock: memmove
        # releases the GIL, and a free or close in another thread must not
        # unmap the buffer in between.
        if isinstance(data, bytes):
            with self._engine._mem_lock:
                dst = self._span(offset, len(data))
                ctypes.memmove(dst, data, len(data))
            return
        with memoryview(data) as mv:
            n = mv.nbytes
            if n:
                # from_buffer needs a writable export; a read-only one is copied once.
                src = (ctypes.c_char * n).from_buffer_copy(mv) if mv.readonly else (ctypes.c_char * n).from_buffer(mv)
            with self._engine._mem_lock:
                dst = self._span(offset, n)
                if n:
                    ctypes.memmove(dst, src, n)

    def read(self, length: Optional[int] = None, offset: int = 0) -> bytes:
        """A copy of length bytes (default: to the end) from offset."""
        offset = _as_int(offset, "offset")
        n = self.length - offset if length is None else _as_int(length, "length")
        with self._engine._mem_lock:  # see write
            src = self._span(offset, n)
            return ctypes.string_at(src, n) if n else b""

    def view(self) -> memoryview:
        """A writable memoryview of the whole buffer, without copying.

        Unsafe by nature: it must not be used after the buffer is freed or
        the engine closed (the memory is unmapped then)."""
        if self.freed:
            raise EngineClosedError(_lib.ERR_CLOSED, f"kvferry.Buffer {self.addr:#x}: the buffer was freed")
        arr = (ctypes.c_char * self.length).from_address(self.addr)
        # The view keeps arr alive, and arr keeps this buffer and its engine:
        # the garbage collector cannot unmap the memory under a live view.
        arr._owner = self  # type: ignore[attr-defined]
        return memoryview(arr).cast("B")

    def free(self) -> None:
        """Same as ``engine.free_buffer(self)``."""
        self._engine.free_buffer(self)


# --------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------

_LOG_LEVELS = {"default": 0, "debug": 1, "info": 2, "warn": 3, "warning": 3, "error": 4, "off": 5}


def _destroy_engine(pid: int, handle: int, keep: dict) -> None:
    """Finalizer of an Engine never closed: destroys it, then lets go of the
    memory it had registered (only then can that memory be released)."""
    if _alive(pid):
        _lib.lib().kvf_engine_destroy(handle)
    keep.clear()


class Engine:
    """A transfer engine: its control plane listens on ``host:port`` and that
    name (:attr:`name`) is how peers open it as a segment.

    Keyword arguments map to kvf_engine_options (0 or None: the default;
    ``KVFERRY_*`` environment variables as they were when the library was
    loaded override them unless ``ignore_env=True``): ``host``
    ("127.0.0.1"), ``port`` (0: a free one), ``protocol`` ("auto": shm with
    peers on this host, rdma with peers that have it when this machine has
    an RDMA device, else tcp; "tcp"; "rdma", which raises UnsupportedError
    without a device; "shm", which refuses peers on other hosts),
    ``paths_per_peer`` (4), ``slice_size`` (1 MiB), ``max_retries`` (2; -1
    none), ``default_timeout_ms`` (30000), ``io_timeout_ms`` (30000),
    ``heartbeat_ms`` (1000), ``heartbeat_misses`` (5), ``log_level`` (int
    KVF_LOG_* or "debug"/"info"/"warn"/"error"/"off"; default
    ``KVFERRY_LOG_LEVEL``, else warn), ``go_max_procs``
    (GOMAXPROCS, 0 keeps it; process-wide, not per engine: one Go runtime
    serves every engine, so the last engine created with a value sets it),
    ``advertise_host`` (the host peers reach us at when it is not ``host``:
    containers, NAT; for a wildcard host, the machine's name or first
    address), and authentication, off unless set: ``secret_key_file`` with
    ``allowlist_file`` (this engine's CURVE secret key, mode 0600, and the
    peers' public keys it lets in, one per line), or ``cluster_secret_file``
    (a secret of at least 16 bytes every engine of the cluster shares). With
    it on, every peer must prove an allowed key on the control plane and on
    tcp data connections, and the engine talks to no peer that does not
    (:class:`UnauthenticatedError`). ``metrics_addr`` ("127.0.0.1:9400";
    port 0 picks one, :attr:`metrics_addr` says which) serves the engine's
    Prometheus metrics over HTTP at ``/metrics``. ``metadata``
    ("etcd://host:port[,host:port]/prefix") keeps this engine's descriptor in
    etcd and finds segments there instead of asking each segment (the
    default, P2P); transfers to open segments go on while the store is away.

    A context manager; :meth:`close` is idempotent, and an engine that is
    garbage collected unclosed is destroyed then. After close, every method
    raises :class:`EngineClosedError` (code KVF_ERR_CLOSED); its segments,
    batches and buffers are invalid."""

    def __init__(self, host: Optional[str] = None, port: int = 0, *, protocol: Optional[str] = None,
                 paths_per_peer: int = 0, slice_size: int = 0, max_retries: int = 0,
                 default_timeout_ms: int = 0, io_timeout_ms: int = 0, heartbeat_ms: int = 0,
                 heartbeat_misses: int = 0, log_level: Union[int, str] = 0, go_max_procs: int = 0,
                 ignore_env: bool = False, advertise_host: Optional[str] = None,
                 secret_key_file: Optional[str] = None, allowlist_file: Optional[str] = None,
                 cluster_secret_file: Optional[str] = None, metrics_addr: Optional[str] = None,
                 metadata: Optional[str] = None) -> None:
        self._h: Optional[int] = None
        lib = _L()
        o = _lib.EngineOptions()
        o.struct_size = ctypes.sizeof(o)
        o.flags = _lib.ENGINE_IGNORE_ENV if ignore_env else 0
        # Keep the encoded strings referenced until the call returns.
        host_b = self._str_opt(host, "host")
        proto_b = self._str_opt(protocol, "protocol")
        o.host, o.protocol = host_b, proto_b
        auth_b = [self._str_opt(v, f) for f, v in (
            ("advertise_host", advertise_host), ("secret_key_file", secret_key_file),
            ("allowlist_file", allowlist_file), ("cluster_secret_file", cluster_secret_file))]
        o.advertise_host, o.secret_key_file, o.allowlist_file, o.cluster_secret_file = auth_b
        metrics_b = self._str_opt(metrics_addr, "metrics_addr")
        o.metrics_addr = metrics_b
        metadata_b = self._str_opt(metadata, "metadata")
        o.metadata = metadata_b
        port = _as_int(port, "port")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port}: must be in [0, 65535]")
        o.port = port
        if isinstance(log_level, str):
            if log_level.lower() not in _LOG_LEVELS:
                raise ValueError(f"log_level {log_level!r}: want one of {sorted(_LOG_LEVELS)}")
            log_level = _LOG_LEVELS[log_level.lower()]
        # ctypes truncates out-of-range ints silently: range-check here.
        for field, value in (("paths_per_peer", paths_per_peer), ("max_retries", max_retries),
                             ("default_timeout_ms", default_timeout_ms), ("io_timeout_ms", io_timeout_ms),
                             ("heartbeat_ms", heartbeat_ms), ("heartbeat_misses", heartbeat_misses),
                             ("log_level", log_level), ("go_max_procs", go_max_procs)):
            v = _as_int(value, field)
            if not -_MAX_I32 - 1 <= v <= _MAX_I32:
                raise ValueError(f"{field} {v}: out of the int32 range")
            setattr(o, field, v)
        o.slice_size = _u64(slice_size, "slice_size")
        h = c_void_p()
        _check(lib, lib.kvf_engine_create(byref(o), byref(h)))
        handle: int = h.value or 0
        self._h = handle
        self._lock = threading.Lock()
        self._mem_lock = threading.Lock()  # held by raw Buffer copies and by what unmaps buffers
        # Registered Python objects by start address: they must stay alive
        # (and unmoved) while the engine may touch them.
        self._keep: dict = {}
        self._buffers: dict = {}
        self._finalizer = weakref.finalize(self, _destroy_engine, os.getpid(), handle, self._keep)
        try:
            self._name = _read_string(lib, lib.kvf_engine_name, handle)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _str_opt(value: Optional[str], what: str) -> Optional[bytes]:
        if value is None:
            return None
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a str, not {type(value).__name__}")
        return value.encode()

    # -- lifecycle --------------------------------------------------------

    def _handle(self) -> int:
        h = self._h
        if h is None:
            raise EngineClosedError(_lib.ERR_CLOSED, f"kvferry.Engine {self._name_or_unknown()}: the engine is closed")
        return h

    def _name_or_unknown(self) -> str:
        return getattr(self, "_name", "?")

    @property
    def handle(self) -> int:
        """The raw kvf_engine handle, for calls through kvferry._lib."""
        return self._handle()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._h is None

    def close(self) -> None:
        """Destroys the engine: transfers in flight end CANCELED, segments
        close, batches are freed, buffers from :meth:`alloc_buffer` are
        unmapped. Returns once the engine no longer touches any memory
        (bounded by one socket write or copy chunk); registered Python
        objects are released then. Idempotent."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before the engine existed
            return
        with lock:
            h, self._h = self._h, None
        if h is None:
            return
        self._finalizer.detach()
        lib = _L()
        with self._mem_lock:  # destroy unmaps the buffers: no raw copy meanwhile
            code = lib.kvf_engine_destroy(h)
            msg = _last_error(lib) if code else ""
            for b in self._buffers.values():
                b._freed = True
            self._buffers.clear()
        self._keep.clear()
        if code:
            raise error_for(code, msg)

    def __enter__(self) -> "Engine":
        self._handle()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvferry.Engine {self._name_or_unknown()}{' closed' if self.closed else ''}>"

    # -- identity ---------------------------------------------------------

    @property
    def name(self) -> str:
        """The segment name peers open: "host:port" ("[::1]:port" for IPv6)."""
        return self._name

    @property
    def host(self) -> str:
        """The host part of :attr:`name` (without IPv6 brackets)."""
        return self._name.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        """The control port the engine listens on."""
        return int(self._name.rsplit(":", 1)[1])

    @property
    def public_key(self) -> Optional[str]:
        """This engine's public key, 40 Z85 characters (what peers list in
        their allowlist files); None when authentication is off."""
        lib = _L()
        try:
            return _read_string(lib, lib.kvf_engine_public_key, self._handle())
        except UnsupportedError:
            return None

    def reload_allowlist(self, timeout: Optional[float] = None) -> None:
        """Reads the allowlist file again; peers whose keys it no longer
        lists are cut before it returns (control and data connections
        closed, rdma QPs destroyed), so nothing of theirs lands afterwards.
        :class:`InvalidArgumentError` without an allowlist file or with an
        unusable one (the allowlist in force stays); :class:`TimedOutError`
        when cutting did not finish in time."""
        ms = _timeout_ms(timeout, allow_zero=False)
        lib = _L()
        _check(lib, lib.kvf_engine_reload_allowlist(self._handle(), ms))

    def stats(self) -> Stats:
        """A snapshot of the engine's counters."""
        lib = _L()
        s = _lib.Stats()
        s.struct_size = ctypes.sizeof(s)
        _check(lib, lib.kvf_engine_stats(self._handle(), byref(s)))
        return Stats(*(getattr(s, f) for f in _STATS_FIELDS))

    @property
    def metrics_addr(self) -> str:
        """Where the engine's metrics are served (``http://<it>/metrics``),
        "" when no listener serves them."""
        lib = _L()
        return _read_string(lib, lib.kvf_metrics_addr, self._handle())

    def metrics_text(self) -> str:
        """The engine's metrics in the Prometheus text format (version
        0.0.4), what a ``/metrics`` endpoint serves; every series carries
        ``engine="<segment name>"``. To serve them from a process that
        already has a ``/metrics`` (SGLang, vLLM), see
        :func:`kvferry.register_prometheus`."""
        return _lib.read_growing_text(_L().kvf_metrics_text, self._handle())

    # -- memory -----------------------------------------------------------

    def register(self, obj: Any, length: Optional[int] = None, *, location: Optional[str] = None) -> int:
        """Registers memory so that transfers (local and by peers) may read
        and write it; returns its start address.

        ``obj``: an int address with ``length`` (the caller keeps it mapped
        until :meth:`unregister` returned); a writable, contiguous object with
        the buffer protocol (bytearray, mmap, ctypes array, ...); a NumPy
        array; or a tensor with ``data_ptr()`` (location from its device,
        "cpu" or "cuda:N"; GPU memory needs the CUDA driver, else
        UnsupportedError).
        Objects are kept referenced (a bytearray cannot be resized, an mmap
        not closed) until unregistered or the engine is closed. ``length``
        may register only the first bytes of an object; ``location``
        overrides the detected one ("cpu", "cpu:N", "*").
        Read-only objects are refused (ValueError): peers may write into
        registered memory. Overlapping ranges: :class:`OverlapError`."""
        info = memory_info(obj, length)
        loc = location if location is not None else info.location
        if not isinstance(loc, str):
            raise TypeError(f"location must be a str, not {type(loc).__name__}")
        lib = _L()
        _check(lib, lib.kvf_register_memory(self._handle(), info.addr, info.length, loc.encode()))
        if info.keepalive is not None:
            self._keep[info.addr] = info
        return info.addr

    def register_many(self, items: Iterable[Any], *, location: Optional[str] = None) -> List[int]:
        """Registers several ranges in one call, all or none; returns their
        addresses. Each item is an object as for :meth:`register`, or an
        ``(obj_or_address, length)`` pair."""
        infos: List[MemoryInfo] = []
        for item in items:
            if isinstance(item, tuple):
                if len(item) != 2:
                    raise ValueError("register_many: a tuple item is (obj_or_address, length)")
                infos.append(memory_info(item[0], item[1]))
            else:
                infos.append(memory_info(item))
        if not infos:
            return []
        if location is not None and not isinstance(location, str):
            raise TypeError(f"location must be a str, not {type(location).__name__}")
        ranges = (_lib.MemoryRange * len(infos))()
        encoded = [(location if location is not None else i.location).encode() for i in infos]
        for r, i, loc in zip(ranges, infos, encoded):
            r.addr, r.len, r.location = i.addr, i.length, loc
        lib = _L()
        _check(lib, lib.kvf_register_memory_batch(self._handle(), ranges, len(infos)))
        for i in infos:
            if i.keepalive is not None:
                self._keep[i.addr] = i
        return [i.addr for i in infos]

    @staticmethod
    def _addr_of(obj: Any) -> int:
        if isinstance(obj, Buffer) or is_int_like(obj):
            return _u64(obj, "address")
        return memory_info(obj).addr

    def unregister(self, obj: Any) -> None:
        """Unregisters the range starting at an address (or at the start of
        a registered object). Returns once no copy into or out of it runs and
        none can start: the memory may be reused or freed at once; the object
        is released. :class:`NotRegisteredError` when nothing starts there."""
        addr = self._addr_of(obj)
        lib = _L()
        _check(lib, lib.kvf_unregister_memory(self._handle(), addr))
        self._keep.pop(addr, None)

    def unregister_many(self, items: Iterable[Any]) -> None:
        """Unregisters several ranges by start address (or object), all or none, in one call."""
        addrs = [self._addr_of(i) for i in items]
        if not addrs:
            return
        arr = (c_void_p * len(addrs))(*addrs)
        lib = _L()
        _check(lib, lib.kvf_unregister_memory_batch(self._handle(), arr, len(addrs)))
        for a in addrs:
            self._keep.pop(a, None)

    def alloc_buffer(self, length: int, location: Optional[str] = None) -> Buffer:
        """Maps ``length`` zero-filled bytes outside any heap (2 MiB huge
        pages when length is a multiple of 2 MiB and the system has them) and
        registers them. The engine owns the memory: :meth:`free_buffer`, or
        :meth:`close`, unmaps it."""
        n = _as_int(length, "length")
        if n <= 0 or n >= 1 << 63:
            raise ValueError(f"length {n}: must be > 0 and < 2**63")
        if location is not None and not isinstance(location, str):
            raise TypeError(f"location must be a str, not {type(location).__name__}")
        lib = _L()
        out = c_void_p()
        _check(lib, lib.kvf_alloc_buffer(self._handle(), n, location.encode() if location else None, byref(out)))
        buf = Buffer(self, out.value or 0, n, location or "cpu")
        self._buffers[buf.addr] = buf
        return buf

    def free_buffer(self, buf: Union[Buffer, int]) -> None:
        """Unregisters (waiting for copies in progress) and unmaps a buffer
        from :meth:`alloc_buffer`; :class:`InvalidArgumentError` when the
        address is not the start of one."""
        addr = _u64(buf, "address")
        lib = _L()
        with self._mem_lock:  # no raw copy of Buffer runs while it unmaps
            _check(lib, lib.kvf_free_buffer(self._handle(), addr))
            b = self._buffers.pop(addr, None)
            if b is not None:
                b._freed = True

    # -- segments and batches ---------------------------------------------

    def open_segment(self, name: str, timeout: Optional[float] = None) -> "Segment":
        """Opens the segment called ``name`` ("host:port"), fetching its
        descriptor from the peer; waits up to ``timeout`` seconds
        (:class:`UnreachableError` when the peer does not answer). The
        engine's own :attr:`name` opens the local segment. Each call returns
        a new handle; close it with :meth:`Segment.close`."""
        if not isinstance(name, str):
            raise TypeError(f"segment name must be a str, not {type(name).__name__}")
        ms = _timeout_ms(timeout, allow_zero=False)
        lib = _L()
        out = c_void_p()
        _check(lib, lib.kvf_open_segment(self._handle(), name.encode(), ms, byref(out)))
        return Segment(self, out.value or 0, name)

    def local_segment(self) -> "Segment":
        """Opens the engine's own segment (transfers become a checked memcpy)."""
        return self.open_segment(self._name)

    def batch(self, capacity: int) -> "Batch":
        """A :class:`Batch` for up to ``capacity`` requests in total."""
        return Batch(self, capacity)

    # -- transfers ----------------------------------------------------------

    def _pack_requests(self, requests: Sequence[RequestLike]) -> Tuple[Any, int]:
        """A ctypes array of kvf_request from Requests and tuples.

        The fast path transposes the requests into columns and converts each
        with array('Q') at C speed (which also refuses non-ints and negative
        values); on any error the checked path runs again to name the
        offending request and field."""
        try:
            rows = requests
            widths = set(map(len, rows))
            if widths == {5} or widths == {5, 6}:
                rows = [tuple(r) if len(r) == 6 else tuple(r) + (0,) for r in rows]
            elif widths != {6}:
                raise ValueError("request widths")
            n = len(rows)
            ops, local, segs, remote, length, rids = zip(*rows)
            op_col = array("Q", ops)
            # set(ops) would hash each Op through Enum's Python-level __hash__: check types and range instead.
            if not set(map(type, ops)) <= _OP_TYPES or max(op_col) > 1:
                raise ValueError("ops")
            first = segs[0]
            if segs.count(first) == n:  # one segment for all: one lookup
                seg_col = array("Q", [_segment_handle(first, self, "segment")]) * n
            else:
                handles = {id(s): _segment_handle(s, self, "segment") for s in segs}
                seg_col = array("Q", [handles[id(s)] for s in segs])
            return _pack(n, op_col, array("Q", local), seg_col, array("Q", remote), array("Q", length),
                         array("Q", rids)), n
        except (TypeError, ValueError, OverflowError):
            return self._pack_requests_checked(requests)

    def _pack_requests_checked(self, requests: Sequence[RequestLike]) -> Tuple[Any, int]:
        """Request by request, with errors naming the request's index."""
        n = len(requests)
        ops = array("Q", bytes(8 * n))
        local = array("Q", bytes(8 * n))
        segs = array("Q", bytes(8 * n))
        remote = array("Q", bytes(8 * n))
        length = array("Q", bytes(8 * n))
        rids = array("Q", bytes(8 * n))
        seg_cache: dict = {}
        for i, r in enumerate(requests):
            if isinstance(r, tuple) and len(r) in (5, 6):
                op, loc, seg, rem, ln = r[:5]
                rid = r[5] if len(r) == 6 else 0
            else:
                raise TypeError(f"request {i}: want a kvferry.Request or a tuple (op, local, segment, remote, "
                                f"length[, request_id]), not {type(r).__name__}")
            sh = seg_cache.get(id(seg))
            if sh is None:
                sh = seg_cache[id(seg)] = _segment_handle(seg, self, f"request {i}: segment")
            try:
                ops[i] = _op(op)
            except (TypeError, ValueError) as e:
                raise type(e)(f"request {i}: {e}") from None
            local[i] = _u64(loc, f"request {i}: local")
            segs[i] = sh
            remote[i] = _u64(rem, f"request {i}: remote")
            length[i] = _u64(ln, f"request {i}: length")
            rids[i] = _u64(rid, f"request {i}: request_id")
        return _pack(n, ops, local, segs, remote, length, rids), n

    def _pack_columns(self, op: Any, segment: "Segment", local: Any, remote: Any, length: Any,
                      request_id: Any) -> Tuple[Any, int]:
        sh = _segment_handle(segment, self, "segment")
        o = _op(op)
        n = next((len(c) for c in (local, remote, length) if not _is_scalar(c)), None)
        if n is None:
            raise TypeError("local, remote and length cannot all be single ints: pass sequences "
                            "(or use write/read for one request)")
        if n == 0:
            return None, 0
        return _pack(n, array("Q", [o]) * n, _column(local, n, "local"), array("Q", [sh]) * n,
                     _column(remote, n, "remote"), _column(length, n, "length"),
                     _column(request_id, n, "request_id")), n

    def _sync(self, reqs: Any, n: int, timeout: Optional[float], check: bool) -> Any:
        ms = _timeout_ms(timeout, allow_zero=False)
        h = self._handle()
        lib = _L()
        out = (_lib.TaskStatus * n)()
        out[0].state = -1  # untouched when the requests were rejected before start
        code = lib.kvf_transfer_sync(h, reqs, n, ms, out)
        if code == _lib.OK:
            return out
        err = error_for(code, _last_error(lib))
        if out[0].state == -1:
            raise err
        if check:
            err.statuses = _statuses(out, n)  # type: ignore[attr-defined]
            raise err
        return out

    def transfer_sync(self, requests: Iterable[RequestLike], timeout: Optional[float] = None, *,
                      check: bool = True) -> List[TaskStatus]:
        """Runs the requests synchronously (one call into the library) and
        returns their statuses once every one is final, or at the deadline
        ``timeout`` (seconds; None: the engine's default): then the
        remaining ones end TIMEOUT, and the call returns only after the
        engine stopped touching their memory.

        When a request did not complete, raises the error of the first one
        (its ``.statuses`` holds every status), unless ``check=False``: then
        the statuses are returned. Requests rejected before start (invalid,
        unregistered memory, ...) always raise."""
        if not isinstance(requests, (list, tuple)):
            requests = list(requests)  # a generator, ...
        if not requests:
            return []
        reqs, n = self._pack_requests(requests)
        return _statuses(self._sync(reqs, n, timeout, check), n)

    def transfer_many(self, op: Op, segment: "Segment", local: Any, remote: Any, length: Any, *,
                      request_id: Any = 0, timeout: Optional[float] = None) -> None:
        """Like :meth:`transfer_sync` for n requests of one op and segment
        given as columns: ``local``, ``remote``, ``length`` and
        ``request_id`` are sequences of n ints (an ``array('Q')`` is used
        as is), or one int for every request. Packed at C speed: the fast
        path for thousands of pages. Returns None; raises like
        :meth:`transfer_sync` (with ``.statuses``)."""
        reqs, n = self._pack_columns(op, segment, local, remote, length, request_id)
        if n:
            self._sync(reqs, n, timeout, True)

    def write_many(self, segment: "Segment", local: Any, remote: Any, length: Any, *, request_id: Any = 0,
                   timeout: Optional[float] = None) -> None:
        """:meth:`transfer_many` with Op.WRITE (our memory into the segment's)."""
        self.transfer_many(Op.WRITE, segment, local, remote, length, request_id=request_id, timeout=timeout)

    def read_many(self, segment: "Segment", local: Any, remote: Any, length: Any, *, request_id: Any = 0,
                  timeout: Optional[float] = None) -> None:
        """:meth:`transfer_many` with Op.READ (the segment's memory into ours)."""
        self.transfer_many(Op.READ, segment, local, remote, length, request_id=request_id, timeout=timeout)

    def write(self, segment: "Segment", local: Any, remote: int, length: int, *, request_id: int = 0,
              timeout: Optional[float] = None) -> TaskStatus:
        """One synchronous WRITE of ``length`` bytes from our ``local`` to the
        segment's ``remote``; returns its status, raises if it did not complete."""
        return self.transfer_sync([Request(Op.WRITE, local, segment, remote, length, request_id)], timeout)[0]

    def read(self, segment: "Segment", local: Any, remote: int, length: int, *, request_id: int = 0,
             timeout: Optional[float] = None) -> TaskStatus:
        """One synchronous READ of ``length`` bytes from the segment's
        ``remote`` into our ``local``; returns its status, raises if it did not complete."""
        return self.transfer_sync([Request(Op.READ, local, segment, remote, length, request_id)], timeout)[0]

    # -- abort, grants, notifications, events -------------------------------

    def abort(self, request_id: int, initiators: Iterable[Union[str, "Segment"]] = (),
              timeout: Optional[float] = None) -> AbortResult:
        """Owner side: aborts ``request_id`` for the ``initiators`` named
        (segment names or Segments; none: refusal alone stops every
        initiator). From the call on every access of the request is refused;
        returns once no copy of it runs (on tcp it does not wait for the
        initiators). Safe: the memory may be reused at once. NotSafe by the
        deadline is returned (``safe=False`` with its reason), not raised;
        invalid arguments raise."""
        rid = _u64(request_id, "request_id")
        if isinstance(initiators, (str, Segment)):
            initiators = [initiators]
        names = []
        for i in initiators:
            if isinstance(i, Segment):
                names.append(i.name.encode())
            elif isinstance(i, str):
                names.append(i.encode())
            else:
                raise TypeError(f"initiators: want segment names (str) or Segments, not {type(i).__name__}")
        ms = _timeout_ms(timeout, allow_zero=False)
        arr = (c_char_p * len(names))(*names) if names else None
        out = _lib.AbortResult()
        out.struct_size = ctypes.sizeof(out)
        out.safe = 0xFFFFFFFF  # the library writes 0 or 1 once the abort ran
        lib = _L()
        code = lib.kvf_abort(self._handle(), rid, arr, len(names), ms, byref(out))
        if code == _lib.OK:
            return AbortResult(True, out.generation, out.bytes_confirmed)
        msg = _last_error(lib)
        if out.safe == 0:
            return AbortResult(False, out.generation, out.bytes_confirmed, msg, code)
        raise error_for(code, msg)

    def fence(self, ranges: Any, timeout: Optional[float] = None) -> FenceResult:
        """Owner side: fences ranges of our registered memory. From the call
        on every access to them planned before it is refused, whatever its
        request id (0 included) and initiator, and whatever the initiator
        does next (paused, retrying, ...): its task ends FAILED with
        :class:`FencedError`, never retried. Transfers planned after the
        call pass: the peers that may plan transfers to us are told, and
        the call waits a little (``KVFERRY_FENCE_GRACE_MS``, 50 ms) for
        their acknowledgements, so a writer told about the pages after it
        returned writes into them normally.

        Unlike :meth:`abort`, which stops only the transfers carrying one
        request id, this stops transfers without one, as Mooncake-based
        frameworks send them: fence a request's pages before reusing them.

        ``ranges``: an iterable of ``(address, length)`` pairs,
        ``(object, length)`` pairs (the first bytes of an object), Buffers,
        or objects naming memory as for :meth:`register` (buffer protocol,
        NumPy arrays, tensors with ``data_ptr()``); or one Buffer or such
        object alone. Each must lie in memory this engine registered
        (:class:`NotRegisteredError` otherwise); at most 524288 ranges, one
        call into the library. Safe: the memory may be reused at once.
        NotSafe by the deadline (``timeout`` seconds; None: the engine's
        default) is returned (``safe=False`` with its reason), not raised;
        invalid arguments raise."""
        if isinstance(ranges, Buffer) or _is_tensor(ranges) or _is_ndarray(ranges):
            ranges = [ranges]
        elif not isinstance(ranges, (list, tuple)) and _has_buffer(ranges):
            ranges = [ranges]
        addrs, lens = array("Q"), array("Q")
        for i, r in enumerate(ranges):
            a, n = _fence_span(r, i)
            addrs.append(a)
            lens.append(n)
        return self._fence(addrs, lens, timeout)

    def fence_many(self, addrs: Any, lengths: Any, timeout: Optional[float] = None) -> FenceResult:
        """:meth:`fence` with columns: ``addrs`` a sequence of n addresses
        (an ``array('Q')`` is used as is), ``lengths`` n lengths or one for
        every range. Converted at C speed: the fast path for thousands of
        pages (every layer's K and V pages of a request). The library checks
        each range (:class:`InvalidArgumentError` naming it for a zero
        length)."""
        if _is_scalar(addrs):
            raise TypeError("addrs must be a sequence of addresses (use fence([(addr, length)]) for one range)")
        a = _column(addrs, len(addrs), "addrs")
        return self._fence(a, _column(lengths, len(a), "lengths"), timeout)

    def _fence(self, addrs: array, lens: array, timeout: Optional[float]) -> FenceResult:
        ms = _timeout_ms(timeout, allow_zero=False)
        n = len(addrs)
        pa = (c_uint64 * n).from_buffer(addrs) if n else None
        pl = (c_uint64 * n).from_buffer(lens) if n else None
        out = _lib.FenceResult()
        out.struct_size = ctypes.sizeof(out)
        out.safe = 0xFFFFFFFF  # the library writes 0 or 1 once the fence ran
        lib = _L()
        code = lib.kvf_fence_memory(self._handle(), pa, pl, n, ms, byref(out))
        if code == _lib.OK:
            return FenceResult(True, out.epoch, out.peers_told, out.peers_acked, out.peers_cut)
        msg = _last_error(lib)
        if out.safe == 0:
            return FenceResult(False, out.epoch, out.peers_told, out.peers_acked, out.peers_cut, msg, code)
        raise error_for(code, msg)

    def grant(self, initiator: Union[str, "Segment"], request_id: int,
              ranges: Iterable[Union[Tuple[int, int], Buffer]]) -> int:
        """Owner side: lets ``initiator`` (a segment name) access ``ranges``
        (``(address, length)`` pairs or Buffers) of our registered memory for
        ``request_id``; returns the grant id. From a request id's first grant
        on, every access of it must fall inside a live grant of its
        initiator, else it is refused (:class:`RefusedError` there)."""
        name = initiator.name if isinstance(initiator, Segment) else initiator
        if not isinstance(name, str):
            raise TypeError(f"initiator must be a segment name (str), not {type(name).__name__}")
        pairs = []
        for r in ranges:
            if isinstance(r, Buffer):
                pairs.append((r.addr, r.length))
            elif isinstance(r, tuple) and len(r) == 2:
                pairs.append(check_range(r[0], r[1]))
            else:
                raise TypeError(f"grant ranges: want (address, length) pairs or Buffers, not {type(r).__name__}")
        arr = (_lib.GrantRange * len(pairs))(*(_lib.GrantRange(a, n) for a, n in pairs)) if pairs else None
        gid = c_uint64()
        lib = _L()
        _check(lib, lib.kvf_grant(self._handle(), name.encode(), _u64(request_id, "request_id"), arr, len(pairs),
                              byref(gid)))
        return gid.value

    def revoke(self, grant_id: int, timeout: Optional[float] = None) -> None:
        """Owner side: withdraws a grant and returns once no copy under it
        runs (:class:`TimedOutError` at the deadline; it stays withdrawn).
        An unknown grant id is :class:`InvalidArgumentError`."""
        ms = _timeout_ms(timeout, allow_zero=False)
        lib = _L()
        _check(lib, lib.kvf_revoke(self._handle(), _u64(grant_id, "grant_id"), ms))

    def notify(self, segment: "Segment", request_id: int, data: Any = b"") -> None:
        """Same as ``segment.notify(request_id, data)``."""
        _segment_handle(segment, self, "segment")
        segment.notify(request_id, data)

    def poll_events(self, timeout: float = 0, max: int = 64) -> List[Event]:
        """Takes up to ``max`` pending events, in arrival order, waiting up to
        ``timeout`` seconds for the first one (0: do not wait); [] when none
        arrived in time."""
        cap = _as_int(max, "max")
        if not 0 < cap <= 1 << 20:  # the library's bound, checked before allocating
            raise ValueError(f"max {cap}: must be in [1, 2**20]")
        if timeout is None:
            raise TypeError("poll_events needs a timeout in seconds (0: do not wait)")
        ms = _timeout_ms(timeout, allow_zero=True)
        buf = (_lib.Event * cap)()
        n = c_size_t(0)
        lib = _L()
        _check(lib, lib.kvf_poll_events(self._handle(), buf, cap, byref(n), ms))
        out = []
        for e in buf[: n.value]:
            try:
                t: Union[EventType, int] = EventType(e.type)
            except ValueError:
                t = e.type
            out.append(Event(t, e.peer.decode(errors="replace"), e.request_id, e.generation,
                             bytes(e.data[: e.data_len])))
        return out

    def event_fd(self) -> int:
        """A file descriptor that polls readable while events may be pending
        (for select/epoll/asyncio's add_reader). Do not read or close it;
        :meth:`poll_events` resets it; the engine's close closes it."""
        fd = c_int(-1)
        lib = _L()
        _check(lib, lib.kvf_event_fd(self._handle(), byref(fd)))
        return fd.value


def _has_buffer(obj: Any) -> bool:
    """Whether obj exports the buffer protocol (bytearray, mmap, ctypes array, ...)."""
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _fence_span(item: Any, i: int) -> Tuple[int, int]:
    """(address, length) of one range given to :meth:`Engine.fence`."""
    try:
        if isinstance(item, Buffer):
            return item.addr, item.length
        if isinstance(item, tuple):
            if len(item) != 2:
                raise TypeError(f"a tuple is (address or object, length), not {len(item)} items")
            obj, n = item
            if is_int_like(obj):
                return check_range(_u64(obj, "address"), n)
            info = memory_info(obj, n)
            return info.addr, info.length
        if is_int_like(item):
            raise TypeError("an int address needs a length: pass (address, length) pairs, e.g. fence([(addr, n)])")
        info = memory_info(item)
        return info.addr, info.length
    except (TypeError, ValueError) as e:
        raise type(e)(f"fence: range {i}: {e}") from None


# --------------------------------------------------------------------------
# Segment
# --------------------------------------------------------------------------

def _segment_handle(seg: Any, engine: Engine, what: str) -> int:
    if not isinstance(seg, Segment):
        raise TypeError(f"{what}: want a kvferry.Segment (from Engine.open_segment), not {type(seg).__name__}")
    if seg._engine is not engine:
        raise ValueError(f"{what}: segment {seg.name} was opened by another engine")
    return seg._handle()


def _close_segment(pid: int, handle: int) -> None:
    if _alive(pid):
        _lib.lib().kvf_close_segment(handle)


def _handle_of(engine: "Engine", h: Optional[int], gone: str) -> int:
    """The handle h of something engine made (a segment, a batch): raises
    EngineClosedError when the engine is closed (the clearer message, so it
    is checked first), else HandleError with message gone when h is None."""
    engine._handle()
    if h is None:
        raise HandleError(_lib.ERR_HANDLE, gone)
    return h


class Segment:
    """An open peer (or the engine itself), from :meth:`Engine.open_segment`.

    A context manager; :meth:`close` is idempotent. When the last handle of
    a name closes, transfers to it still in flight fail."""

    def __init__(self, engine: Engine, handle: int, name: str) -> None:
        self._engine = engine
        self._h: Optional[int] = handle
        self._name = name
        self._finalizer = weakref.finalize(self, _close_segment, os.getpid(), handle)

    @property
    def name(self) -> str:
        """The segment name it was opened by ("host:port")."""
        return self._name

    @property
    def engine(self) -> Engine:
        """The engine that opened it."""
        return self._engine

    @property
    def closed(self) -> bool:
        """Whether the segment (or its engine) was closed."""
        return self._h is None or self._engine.closed

    def _handle(self) -> int:
        return _handle_of(self._engine, self._h, f"kvferry.Segment {self._name}: the segment is closed")

    @property
    def handle(self) -> int:
        """The raw kvf_segment handle, for calls through kvferry._lib."""
        return self._handle()

    def buffers(self) -> List[Tuple[int, int]]:
        """(address, length) of the peer's registered buffers, in address
        order, from the descriptor cached at open (refreshed when a request
        names a range it lacks)."""
        h = self._handle()
        lib = _L()
        n = c_size_t(0)
        _check(lib, lib.kvf_segment_buffer_count(h, byref(n)))
        out = []
        a, ln = c_uint64(), c_uint64()
        for i in range(n.value):
            _check(lib, lib.kvf_segment_buffer(h, i, byref(a), byref(ln)))
            out.append((a.value, ln.value))
        return out

    def buffer(self, index: int) -> Tuple[int, int]:
        """(address, length) of the peer's buffer number ``index``
        (:class:`InvalidArgumentError` when out of range)."""
        h = self._handle()
        lib = _L()
        a, ln = c_uint64(), c_uint64()
        _check(lib, lib.kvf_segment_buffer(h, _index(index), byref(a), byref(ln)))
        return a.value, ln.value

    def notify(self, request_id: int, data: Any = b"") -> None:
        """Sends a small message (at most 64 bytes) about ``request_id`` to
        the segment's engine, which gets it as an EventType.NOTIFY event.
        Returns once the peer queued it. Raises :class:`BusyError` when the
        peer's event queue is full (backpressure: retry later), chosen over
        returning False so that a lost notification cannot go unnoticed;
        :class:`UnreachableError` after the engine's default timeout. Sent
        after a WRITE completed, it arrives after that WRITE's bytes are
        visible at the peer."""
        rid = _u64(request_id, "request_id")
        if isinstance(data, (str, int)):
            # bytes(10) would be ten zero bytes, and bytes(10**12) a huge
            # allocation: only bytes-like objects are data.
            raise TypeError(f"notify data must be bytes-like, not {type(data).__name__}")
        with memoryview(data) as mv:
            payload = mv.tobytes()
        if len(payload) > _lib.EVENT_DATA_MAX:
            raise ValueError(f"notify data is {len(payload)} bytes; at most {_lib.EVENT_DATA_MAX}")
        lib = _L()
        _check(lib, lib.kvf_notify(self._handle(), rid, payload, len(payload)))

    def close(self) -> None:
        """Closes the handle; idempotent, and a no-op after the engine's close."""
        h, self._h = self._h, None
        if h is None:
            return
        self._finalizer.detach()
        if self._engine.closed:
            return  # the engine's destroy closed it already
        lib = _L()
        _check(lib, lib.kvf_close_segment(h))

    def __enter__(self) -> "Segment":
        self._handle()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvferry.Segment {self._name}{' closed' if self.closed else ''}>"


# --------------------------------------------------------------------------
# Batch
# --------------------------------------------------------------------------

def _free_batch(pid: int, handle: int) -> None:
    """Finalizer of a batch never freed: cancel what runs, then free."""
    if not _alive(pid):
        return
    lib = _lib.lib()
    if lib.kvf_batch_free(handle) == _lib.ERR_BUSY:
        lib.kvf_batch_cancel(handle)
        lib.kvf_batch_free(handle)


class Batch:
    """A set of asynchronous requests waited on together, for up to
    ``capacity`` requests in total; task i is the i-th request submitted.

    A context manager: on exit, tasks still in flight are canceled (which
    returns once the engine no longer touches their memory) and the batch
    is freed."""

    def __init__(self, engine: Engine, capacity: int) -> None:
        cap = _index(capacity, "capacity")
        if cap <= 0:
            raise ValueError(f"capacity {cap}: must be > 0")
        lib = _L()
        out = c_void_p()
        _check(lib, lib.kvf_batch_alloc(engine._handle(), cap, byref(out)))
        self._engine = engine
        self._h: Optional[int] = out.value or 0
        self._capacity = cap
        self._submitted = 0
        self._finalizer = weakref.finalize(self, _free_batch, os.getpid(), self._h)

    @property
    def capacity(self) -> int:
        """Requests the batch can take in total."""
        return self._capacity

    def __len__(self) -> int:
        """Requests submitted so far."""
        return self._submitted

    @property
    def freed(self) -> bool:
        """Whether the batch (or its engine) is gone."""
        return self._h is None or self._engine.closed

    def _handle(self) -> int:
        return _handle_of(self._engine, self._h, "kvferry.Batch: the batch was freed")

    def _submit(self, reqs: Any, n: int) -> range:
        lib = _L()
        _check(lib, lib.kvf_batch_submit(self._handle(), reqs, n))
        first = self._submitted
        self._submitted += n
        return range(first, first + n)

    def submit(self, requests: Iterable[RequestLike]) -> range:
        """Checks every request, then starts them all (one call); if any is
        invalid none starts and the error names its index. Returns the task
        indices of the requests."""
        if not isinstance(requests, (list, tuple)):
            requests = list(requests)
        if not requests:
            return range(self._submitted, self._submitted)
        reqs, n = self._engine._pack_requests(requests)
        return self._submit(reqs, n)

    def submit_many(self, op: Op, segment: Segment, local: Any, remote: Any, length: Any, *,
                    request_id: Any = 0) -> range:
        """Like :meth:`submit` with columns, as :meth:`Engine.transfer_many`."""
        reqs, n = self._engine._pack_columns(op, segment, local, remote, length, request_id)
        if not n:
            return range(self._submitted, self._submitted)
        return self._submit(reqs, n)

    def status(self, index: int) -> TaskStatus:
        """The status of task ``index``; never blocks."""
        lib = _L()
        s = _lib.TaskStatus()
        _check(lib, lib.kvf_batch_status(self._handle(), _index(index), byref(s)))
        return _status(s.state, s.error, s.transferred)

    def statuses(self) -> List[TaskStatus]:
        """The statuses of every submitted task, in submission order (one call)."""
        h = self._handle()
        lib = _L()
        n = self._submitted
        out = (_lib.TaskStatus * max(n, 1))()
        got = c_size_t(0)
        _check(lib, lib.kvf_batch_status_all(h, out, n, byref(got)))
        return _statuses(out, min(n, got.value))

    def task_error(self, index: int) -> str:
        """The message of task ``index``'s error ("" in flight or completed)."""
        h = self._handle()
        lib = _L()
        i = _index(index)
        n = c_size_t(0)
        buf = ctypes.create_string_buffer(512)
        code = lib.kvf_batch_task_error(h, i, buf, len(buf), byref(n))
        if code == _lib.ERR_TRUNCATED:
            buf = ctypes.create_string_buffer(n.value + 1)
            code = lib.kvf_batch_task_error(h, i, buf, len(buf), byref(n))
        _check(lib, code)
        return buf.value.decode(errors="replace")

    def wait(self, timeout: Optional[float] = None, *, check: bool = True) -> bool:
        """Waits until every task is final or ``timeout`` seconds passed (0:
        do not wait; None: the engine's default). Returns True when every
        task is final, False when tasks are still in flight (they keep
        running: wait again, or cancel). When some task did not complete,
        raises its error (with ``.statuses``) unless ``check=False``."""
        ms = _timeout_ms(timeout, allow_zero=True)
        h = self._handle()
        lib = _L()
        code = lib.kvf_batch_wait(h, ms)
        if code == _lib.OK:
            return True
        err = error_for(code, _last_error(lib))
        if code in (_lib.ERR_HANDLE, _lib.ERR_CLOSED, _lib.ERR_INVALID):
            raise err
        sts = self.statuses()
        if not all(s.final for s in sts):
            return False
        if check:
            err.statuses = sts  # type: ignore[attr-defined]
            raise err
        return True

    def cancel(self) -> None:
        """Ends every task still in flight as CANCELED; returns once the
        engine no longer touches their memory. :class:`MemoryInUseError`
        when that could not be confirmed within about 6 s (a NIC that
        neither completes nor flushes its work)."""
        lib = _L()
        _check(lib, lib.kvf_batch_cancel(self._handle()))

    def free(self) -> None:
        """Frees the batch; :class:`BusyError` while tasks are in flight
        (wait or cancel first). Idempotent; a no-op after the engine's close."""
        h = self._h
        if h is None:
            return
        if self._engine.closed:
            self._h = None
            self._finalizer.detach()
            return
        lib = _L()
        _check(lib, lib.kvf_batch_free(h))
        self._h = None
        self._finalizer.detach()

    def __enter__(self) -> "Batch":
        self._handle()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.freed:
            self._h = None
            self._finalizer.detach()
            return
        try:
            self.free()
        except BusyError:
            self.cancel()
            self.free()

    def __repr__(self) -> str:
        return f"<kvferry.Batch {self._submitted}/{self._capacity}{' freed' if self.freed else ''}>"
