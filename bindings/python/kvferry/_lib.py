"""Low-level ctypes binding of libkvferry.so: structs, status codes and the
prototypes of every kvf_* function, each with argtypes and restype.

Everything else in the package builds on this module; applications should use
kvferry.Engine (or kvferry.mooncake.TransferEngine) instead.

The library is found, in order, at $KVFERRY_LIBRARY, next to this file (a
wheel or `make python` copies it in), or through the system's loader
("libkvferry.so.0"). ctypes releases the GIL around every call into it.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import List, Optional

# The header's KVF_VERSION_MAJOR this binding was written for.
ABI_MAJOR = 0
# The oldest library minor version with every function declared here.
ABI_MIN_MINOR = 7

TIMEOUT_DEFAULT = -1
EVENT_DATA_MAX = 64
EVENT_PEER_MAX = 64
ENGINE_IGNORE_ENV = 0x1

# Status codes (kvf_status).
OK = 0
ERR_INVALID = 1
ERR_HANDLE = 2
ERR_OVERLAP = 3
ERR_NOT_REGISTERED = 4
ERR_REMOTE_RANGE = 5
ERR_STALE_KEY = 6
ERR_REFUSED = 7
ERR_TIMEOUT = 8
ERR_CANCELED = 9
ERR_CONNECTION = 10
ERR_UNREACHABLE = 11
ERR_BUSY = 12
ERR_BATCH_FULL = 13
ERR_CLOSED = 14
ERR_UNSUPPORTED = 15
ERR_TRANSFER_FAILED = 16
ERR_NO_MEMORY = 17
ERR_INTERNAL = 18
ERR_ABORTED = 19
ERR_PROTOCOL = 20
ERR_TRUNCATED = 21
ERR_IN_USE = 22
ERR_FENCED = 23
ERR_UNAUTHENTICATED = 24

FENCE_RANGES_MAX = 524288

# kvf_op
OP_READ = 0
OP_WRITE = 1


class EngineOptions(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("flags", c_uint32),
        ("host", c_char_p),
        ("protocol", c_char_p),
        ("port", c_int32),
        ("paths_per_peer", c_int32),
        ("slice_size", c_uint64),
        ("max_retries", c_int32),
        ("default_timeout_ms", c_int32),
        ("io_timeout_ms", c_int32),
        ("heartbeat_ms", c_int32),
        ("heartbeat_misses", c_int32),
        ("log_level", c_int32),
        ("go_max_procs", c_int32),
        ("reserved", c_int32),
        ("advertise_host", c_char_p),
        ("secret_key_file", c_char_p),
        ("allowlist_file", c_char_p),
        ("cluster_secret_file", c_char_p),
        ("metrics_addr", c_char_p),
        ("metadata", c_char_p),
    ]


class Stats(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("reserved", c_uint32),
        ("bytes_written", c_uint64),
        ("bytes_read", c_uint64),
        ("tasks_completed", c_uint64),
        ("tasks_failed", c_uint64),
        ("tasks_canceled", c_uint64),
        ("tasks_in_flight", c_int64),
        ("retries", c_uint64),
        ("owner_bytes_in", c_uint64),
        ("owner_bytes_out", c_uint64),
        ("owner_refused", c_uint64),
        ("refused_in_flight", c_uint64),
        ("protocol_errors", c_uint64),
        ("control_dropped", c_uint64),
        ("control_late", c_uint64),
        ("registrations", c_uint64),
        ("open_segments", c_uint64),
        ("aborts_safe", c_uint64),
        ("aborts_not_safe", c_uint64),
        ("abort_acks", c_uint64),
        ("acks_unmatched", c_uint64),
        ("aborts_received", c_uint64),
        ("tasks_aborted", c_uint64),
        ("tombstones", c_uint64),
        ("events_dropped", c_uint64),
        ("control_conns", c_uint64),
        ("control_conns_refused", c_uint64),
        ("control_conns_cut", c_uint64),
        ("control_over_budget", c_uint64),
        ("control_send_fails", c_uint64),
        ("data_conns", c_uint64),
        ("conns_refused", c_uint64),
        ("idle_closed", c_uint64),
        ("frame_timeouts", c_uint64),
        ("accept_errors", c_uint64),
        ("aborts_dropped", c_uint64),
        ("canceled_dropped", c_uint64),
        ("rdma_responder_qps", c_uint64),
        ("rdma_connects_refused", c_uint64),
        ("fences_safe", c_uint64),
        ("fences_not_safe", c_uint64),
        ("fence_epoch", c_uint64),
        ("fence_refused", c_uint64),
        ("fence_acks", c_uint64),
        ("fence_acks_unmatched", c_uint64),
        ("fences_received", c_uint64),
        ("auth_refused", c_uint64),
    ]


class MemoryRange(Structure):
    _fields_ = [("addr", c_void_p), ("len", c_size_t), ("location", c_char_p)]


class Request(Structure):
    _fields_ = [
        ("op", c_uint32),
        ("flags", c_uint32),
        ("local", c_void_p),
        ("segment", c_void_p),
        ("remote", c_uint64),
        ("length", c_uint64),
        ("request_id", c_uint64),
    ]


class TaskStatus(Structure):
    _fields_ = [("state", c_int32), ("error", c_int32), ("transferred", c_uint64)]


class AbortResult(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("safe", c_uint32),
        ("generation", c_uint64),
        ("bytes_confirmed", c_uint64),
    ]


class FenceResult(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("safe", c_uint32),
        ("epoch", c_uint64),
        ("peers_told", c_uint32),
        ("peers_acked", c_uint32),
        ("peers_cut", c_uint32),
        ("reserved", c_uint32),
    ]


class GrantRange(Structure):
    _fields_ = [("addr", c_uint64), ("len", c_uint64)]


class Event(Structure):
    _fields_ = [
        ("type", c_uint32),
        ("data_len", c_uint32),
        ("request_id", c_uint64),
        ("generation", c_uint64),
        ("peer", c_char * EVENT_PEER_MAX),
        ("data", c_uint8 * EVENT_DATA_MAX),
    ]


class KvferryError(Exception):
    """A kvf_* call failed: code is the kvf_status, message the library's
    kvf_last_error text (it names the call and the cause)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} [{status_name(code)}]")
        self.code = code
        self.message = message

    def __reduce__(self):
        # Rebuilt from (code, message), so it crosses multiprocessing pipes.
        return (type(self), (self.code, self.message))


class LibraryNotFound(ImportError):
    """libkvferry.so could not be loaded; the message lists where it looked."""


_lib: Optional[ctypes.CDLL] = None


def _candidates() -> List[str]:
    out = []
    env = os.environ.get("KVFERRY_LIBRARY")
    if env:
        out.append(env)
    here = Path(__file__).resolve().parent
    for name in ("libkvferry.so", "libkvferry.so.0"):
        p = here / name
        if p.exists():
            out.append(str(p))
    out.append("libkvferry.so.0")
    return out


def lib() -> ctypes.CDLL:
    """The loaded library, loading and declaring it on first use."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        _declare(handle)
        major, minor = divmod(handle.kvf_version(), 10000)
        minor //= 100
        if major != ABI_MAJOR or minor < ABI_MIN_MINOR:
            raise LibraryNotFound(
                f"{path} is libkvferry {handle.kvf_version_string().decode()}; this binding needs "
                f"{ABI_MAJOR}.{ABI_MIN_MINOR} or a later {ABI_MAJOR}.x")
        _lib = handle
        return handle
    raise LibraryNotFound(
        "cannot load libkvferry.so; looked at (in order): " + "; ".join(tried)
        + ". Set KVFERRY_LIBRARY to the library's path, install the kvferry wheel, or run `make python`.")


def _declare(l: ctypes.CDLL) -> None:
    """Sets argtypes and restype of every function the binding uses."""
    st = c_int
    vp = c_void_p
    sz = c_size_t
    szp = POINTER(c_size_t)
    protos = {
        "kvf_version": (c_uint32, []),
        "kvf_version_string": (c_char_p, []),
        "kvf_status_str": (c_char_p, [c_int]),
        "kvf_last_error": (c_char_p, []),
        "kvf_task_state_str": (c_char_p, [c_int]),
        "kvf_engine_create": (st, [POINTER(EngineOptions), POINTER(vp)]),
        "kvf_engine_destroy": (st, [vp]),
        "kvf_engine_name": (st, [vp, c_char_p, sz, szp]),
        "kvf_engine_public_key": (st, [vp, c_char_p, sz, szp]),
        "kvf_engine_reload_allowlist": (st, [vp, c_int]),
        "kvf_engine_stats": (st, [vp, POINTER(Stats)]),
        "kvf_metrics_text": (st, [vp, c_char_p, sz, szp]),
        "kvf_metrics_addr": (st, [vp, c_char_p, sz, szp]),
        "kvf_register_memory": (st, [vp, vp, sz, c_char_p]),
        "kvf_unregister_memory": (st, [vp, vp]),
        "kvf_register_memory_batch": (st, [vp, POINTER(MemoryRange), sz]),
        "kvf_unregister_memory_batch": (st, [vp, POINTER(vp), sz]),
        "kvf_alloc_buffer": (st, [vp, sz, c_char_p, POINTER(vp)]),
        "kvf_free_buffer": (st, [vp, vp]),
        "kvf_open_segment": (st, [vp, c_char_p, c_int, POINTER(vp)]),
        "kvf_close_segment": (st, [vp]),
        "kvf_segment_buffer_count": (st, [vp, szp]),
        "kvf_segment_buffer": (st, [vp, sz, POINTER(c_uint64), POINTER(c_uint64)]),
        "kvf_segment_name": (st, [vp, c_char_p, sz, szp]),
        "kvf_batch_alloc": (st, [vp, sz, POINTER(vp)]),
        "kvf_batch_submit": (st, [vp, POINTER(Request), sz]),
        "kvf_batch_status": (st, [vp, sz, POINTER(TaskStatus)]),
        "kvf_batch_status_all": (st, [vp, POINTER(TaskStatus), sz, szp]),
        "kvf_batch_task_error": (st, [vp, sz, c_char_p, sz, szp]),
        "kvf_batch_wait": (st, [vp, c_int]),
        "kvf_batch_cancel": (st, [vp]),
        "kvf_batch_free": (st, [vp]),
        "kvf_transfer_sync": (st, [vp, POINTER(Request), sz, c_int, POINTER(TaskStatus)]),
        "kvf_abort": (st, [vp, c_uint64, POINTER(c_char_p), sz, c_int, POINTER(AbortResult)]),
        "kvf_grant": (st, [vp, c_char_p, c_uint64, POINTER(GrantRange), sz, POINTER(c_uint64)]),
        "kvf_revoke": (st, [vp, c_uint64, c_int]),
        "kvf_notify": (st, [vp, c_uint64, c_void_p, sz]),
        "kvf_poll_events": (st, [vp, POINTER(Event), sz, szp, c_int]),
        "kvf_event_fd": (st, [vp, POINTER(c_int)]),
        "kvf_fence_memory": (st, [vp, POINTER(c_uint64), POINTER(c_uint64), sz, c_int, POINTER(FenceResult)]),
    }
    for name, (res, args) in protos.items():
        f = getattr(l, name)
        f.restype = res
        f.argtypes = args


def status_name(code: int) -> str:
    """The library's name of a status code ("invalid argument", ...)."""
    l = _lib
    if l is None:
        return f"status {code}"
    return l.kvf_status_str(code).decode()


def read_growing_text(fn, handle) -> str:
    """Calls a kvf_metrics_text-style function, whose text may grow between
    a length query and the call that copies it: it retries with headroom."""
    n = c_size_t(0)
    check(fn(handle, None, 0, ctypes.byref(n)))
    for _ in range(8):
        buf = ctypes.create_string_buffer(n.value + n.value // 4 + 4096)
        code = fn(handle, buf, len(buf), ctypes.byref(n))
        if code != ERR_TRUNCATED:
            check(code)
            return buf.raw[:n.value].decode()
    check(code)
    raise AssertionError("unreachable")


def check(code: int) -> None:
    """Raises KvferryError for a non-OK status, with the calling thread's
    last-error message (read on the same thread, right after the call)."""
    if code != OK:
        raise KvferryError(code, lib().kvf_last_error().decode(errors="replace"))


def read_string(fn, handle) -> str:
    """Calls a kvf_*_name-style function (handle, buf, cap, len_out)."""
    n = c_size_t(0)
    buf = ctypes.create_string_buffer(256)
    code = fn(handle, buf, len(buf), ctypes.byref(n))
    if code == ERR_TRUNCATED:
        buf = ctypes.create_string_buffer(n.value + 1)
        code = fn(handle, buf, len(buf), ctypes.byref(n))
    check(code)
    return buf.value.decode()
