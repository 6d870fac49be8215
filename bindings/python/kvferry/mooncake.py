"""A drop-in replacement for Mooncake's ``mooncake.engine.TransferEngine``.

Switch by changing one import::

    # from mooncake.engine import TransferEngine
    from kvferry.mooncake import TransferEngine

Every method has the name, arguments and return convention of Mooncake's
pybind class (``transfer_engine_py.cpp``): integer status codes (0 success,
negative failure) where Mooncake returns them, batch ids (0 on failure),
addresses (0 on failure) and ``bytes``. Like Mooncake's binding it raises
``TypeError`` for arguments of the wrong type and never raises where Mooncake
returns a code. Calls made before ``initialize()`` succeeded, or after
``close()``, raise ``RuntimeError`` (Mooncake dereferences a null engine and
crashes the interpreter there).

kvferry extensions on the same class (absent from Mooncake):

- a keyword-only ``request_id=`` on every transfer call: the request id that
  the owner of the memory can abort;
- ``abort(request_id, initiators, timeout)``: the owner's safe abort of the
  transfers that carry a request id;
- ``fence_memory(addrs, lengths, timeout)``: the owner's fence of memory
  ranges, which stops every transfer planned before it, with or without a
  request id: what decode calls before it frees a room's pages when the
  prefill side passes no request id (SGLang's and vLLM's wrappers today);
- ``get_session_id()``, ``last_error()`` (code and message of this thread's
  last failure), ``close()`` and the context-manager protocol;
- ``TransferEngine(transfer_timeout=seconds)`` to set the sync deadline
  without ``MC_TRANSFER_TIMEOUT``.

Every deviation from Mooncake is listed in ``MOONCAKE.md`` next to the
package. Process rule: once this module loaded libkvferry.so, start child
processes with the "spawn" or "forkserver" method, never plain fork().
"""

from __future__ import annotations

import ctypes
import enum
import logging
import operator
import os
import socket
import sys
import threading
import time
from array import array
from ctypes import byref, c_char_p, c_uint64, c_void_p
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from . import _lib
from ._lib import KvferryError

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "P2PHANDSHAKE"]

log = logging.getLogger("kvferry.mooncake")

P2PHANDSHAKE = "P2PHANDSHAKE"


def _metadata_url(server: str, mtype: Optional[str]) -> Optional[str]:
    """Mooncake's metadata server (and type) as the engine's metadata option:
    None for the P2P handshake, "etcd://..." for an etcd cluster. Raises
    ValueError, naming what is supported, for anything else."""
    kind = (mtype or "").strip().lower()
    if server == P2PHANDSHAKE or (server.lower() in ("p2p", "p2phandshake") and kind in ("", "p2p")):
        return None
    scheme, sep, rest = server.partition("://")
    if not sep:
        scheme, rest = kind or "etcd", server  # Mooncake reads a bare address as etcd
    scheme = scheme.lower()
    if kind and kind not in (scheme, "p2p"):
        raise ValueError(f"metadata server {server!r} is not of type {mtype!r}")
    if scheme != "etcd":
        raise ValueError(f"metadata server {server!r} of type {scheme!r} is not supported; kvferry finds segments "
                         f"in etcd (etcd://host:port or host:port) or peer to peer ({P2PHANDSHAKE!r})")
    hosts, slash, prefix = rest.partition("/")
    hosts = ",".join(h.strip() for h in hosts.replace(";", ",").split(",") if h.strip())
    if not hosts:
        raise ValueError(f"metadata server {server!r}: no etcd endpoint (want host:port)")
    return "etcd://" + hosts + (slash + prefix if prefix else "")

# kvf_op values from include/kvferry.h (KVF_OP_READ = 0, KVF_OP_WRITE = 1).
# Defined here rather than taken from _lib, whose OP_READ/OP_WRITE (1/2) do not
# match the header (reported to the lead; with them a "read" would be a WRITE).
_KVF_OP_READ = 0
_KVF_OP_WRITE = 1

# kvf_task_state values.
_TASK_COMPLETED = 2
_TASK_FAILED = 3
_TASK_TIMEOUT = 4

# Mooncake's error codes (mooncake-transfer-engine/include/error.h) that the
# calls below return where Mooncake's own would.
MC_ERR_INVALID_ARGUMENT = -1
MC_ERR_ADDRESS_NOT_REGISTERED = -3
MC_ERR_ADDRESS_OVERLAPPED = -7
MC_ERR_DNS = -101
MC_ERR_SOCKET = -102

# Mooncake: MC_TRANSFER_TIMEOUT seconds (at least 5), default 30.
_MC_DEFAULT_TIMEOUT_S = 30
_MC_MIN_TIMEOUT_S = 5
_INT32_MAX = 2**31 - 1
# How long the fail-fast TCP check of a new session may take (see _open).
_CONNECT_CHECK_S = 1.0

# Segments whose failure means the cached handle is no use any more: evicted
# so the next call opens the session again (Mooncake closes the segment and
# drops its descriptor when CheckSegmentStatus fails).
_EVICT_CODES = frozenset({_lib.ERR_UNREACHABLE, _lib.ERR_CONNECTION, _lib.ERR_HANDLE})

_MEMORY_CODES = {
    _lib.ERR_OVERLAP: MC_ERR_ADDRESS_OVERLAPPED,
    _lib.ERR_NOT_REGISTERED: MC_ERR_ADDRESS_NOT_REGISTERED,
}

# The first word of a packed kvf_request holds op (low half) and flags (0).
_OP_SHIFT = 0 if sys.byteorder == "little" else 32
_REQ_WORDS = ctypes.sizeof(_lib.Request) // 8
assert _REQ_WORDS == 6, "kvf_request layout changed"


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode`` (same values)."""

    Read = 0
    Write = 1


class TransferNotify:
    """Mooncake's ``TransferNotify(name, msg)``; accepted for signature
    compatibility only (notify-with-transfer is not supported: see MOONCAKE.md)."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg


def _mc_timeout_seconds(value: Optional[str]) -> int:
    """MC_TRANSFER_TIMEOUT as Mooncake reads it: atoi(), at least 5 s; 30 s
    when unset."""
    if value is None:
        return _MC_DEFAULT_TIMEOUT_S
    # atoi: optional whitespace and sign, leading digits, 0 when none.
    s = value.lstrip()
    i = 1 if s[:1] in ("+", "-") else 0
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    n = int(s[:j]) if j > i else 0
    return max(_MC_MIN_TIMEOUT_S, n)


def _uint(value: object, what: str) -> int:
    """An unsigned integer argument, rejected with TypeError like pybind11
    rejects a non-int or negative value for a uintptr_t/size_t parameter."""
    try:
        v = operator.index(value)  # int, numpy integers, not float/str
    except TypeError:
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}") from None
    if v < 0 or v >= 1 << 64:
        raise TypeError(f"{what}: {v} is not an unsigned 64-bit value")
    return v


def _uint_array(values: Iterable[object], what: str) -> array:
    """A list of unsigned ints as array('Q'), converted in C; TypeError for
    wrong element types or negative values, like pybind11."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what}: expected a list of int, got {type(values).__name__}")
    try:
        return array("Q", values)
    except (TypeError, OverflowError) as e:
        raise TypeError(f"{what}: expected a list of unsigned int ({e})") from None


def _str(value: object, what: str) -> str:
    """A string argument (pybind11 accepts str and bytes for const char*)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"{what}: expected a str, got {type(value).__name__}")


def _split_hostport(name: str) -> Tuple[str, Optional[int]]:
    """"host", "host:port", "[v6]" or "[v6]:port" as (host, port or None).
    A bare IPv6 address (several colons, no brackets) has no port. ValueError
    for a port that is not a number in 0..65535."""
    if name.startswith("["):
        host, _, rest = name[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else None
    elif name.count(":") == 1:
        host, port_s = name.split(":")
    else:
        host, port_s = name, None
    if port_s is None:
        return host, None
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range")
    return host, port


class _Batch:
    """An asynchronous batch: its kvf_batch handle and Mooncake's deadline
    (transfer timeout plus 1 ns per byte, from submission)."""

    __slots__ = ("handle", "deadline", "name", "seg")

    def __init__(self, handle: int, deadline: float, name: str, seg: int) -> None:
        self.handle = handle
        self.deadline = deadline
        self.name = name  # session, to drop it when the batch shows it dead
        self.seg = seg


class TransferEngine:
    """kvferry's implementation of ``mooncake.engine.TransferEngine``.

    Thread-safe: every method may be called from any thread; blocking calls
    release the GIL (ctypes does so around each call into the library).
    """

    # Mooncake exposes the opcodes on the class too.
    TransferOpcode = TransferOpcode

    def __init__(self, transfer_timeout: Optional[float] = None) -> None:
        """Like Mooncake, reads ``MC_TRANSFER_TIMEOUT`` (seconds, at least 5,
        default 30) here. ``transfer_timeout`` (seconds, kvferry extension)
        replaces it, without the 5 s floor."""
        if transfer_timeout is None:
            self._timeout_s: float = float(_mc_timeout_seconds(os.environ.get("MC_TRANSFER_TIMEOUT")))
        else:
            if not transfer_timeout > 0:
                raise ValueError("transfer_timeout must be > 0 seconds")
            self._timeout_s = float(transfer_timeout)
        self._lib = _lib.lib()
        self._engine: Optional[int] = None
        self._closed = False
        self._name = ""
        # Guards the tables below; never held across a blocking library call
        # except segment opening, which Mooncake serialises the same way.
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._segments: Dict[str, int] = {}
        self._batches: Dict[int, _Batch] = {}
        self._managed: Set[int] = set()
        self._ranges: Dict[int, int] = {}  # registered or allocated through us: start -> length
        self._raw_lock = threading.Lock()  # held by raw copies and by what unmaps managed buffers
        self._pid = os.getpid()
        self._tls = threading.local()

    # ------------------------------------------------------------------ setup

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Creates the engine. ``local_hostname`` is "host" (a free port is
        picked) or "host:port" (that port is listened on); the host may be a
        name ("localhost", the machine's name) or an address, and the
        session id keeps it as given. ``metadata_server`` is
        "P2PHANDSHAKE" (segments asked themselves) or an etcd cluster as
        Mooncake names one: "etcd://host:port[,host:port]" or the bare
        "host:port[;host:port]" (segments found there under the prefix
        "kvferry", or the URL's path); redis and http metadata servers are
        refused (-1). ``protocol`` is "tcp" or "rdma"; "rdma" takes rdma
        with peers on other hosts and shm with peers on this host, and, as
        Mooncake does, on a host without a usable RDMA device falls back to
        tcp (shm on this host) with one WARNING naming the reason;
        ``MC_FORCE_TCP=1`` forces tcp. ``KVFERRY_PROTOCOL``, read now, overrides both and is strict:
        ``KVFERRY_PROTOCOL=rdma`` without a device is an error.
        ``device_name`` is accepted and unused. Returns 0, or -1 with the
        reason logged."""
        local_hostname = _str(local_hostname, "local_hostname")
        metadata_server = _str(metadata_server, "metadata_server")
        protocol = _str(protocol, "protocol")
        _str(device_name, "device_name")
        if self._closed:
            raise RuntimeError("kvferry.mooncake.TransferEngine: initialize() after close()")
        if self._engine is not None:
            return self._fail(_lib.ERR_INVALID, "initialize: already initialized")
        try:
            metadata_url = _metadata_url(metadata_server, None)
        except ValueError as e:
            return self._fail(_lib.ERR_UNSUPPORTED, f"initialize: {e}")
        # Read here, not by the Go runtime (which saw the environment only as
        # it was when the library loaded), so callers that hardcode "rdma"
        # can be pointed at "tcp" without code changes.
        env_proto = os.environ.get("KVFERRY_PROTOCOL")
        strict = bool(env_proto)
        if env_proto:
            if env_proto != protocol:
                log.info("KVFERRY_PROTOCOL=%s overrides protocol %r", env_proto, protocol)
            protocol = env_proto
        elif protocol == "rdma" and os.environ.get("MC_FORCE_TCP", "").lower() in ("1", "true", "yes", "on"):
            log.info("MC_FORCE_TCP=%s: protocol 'rdma' becomes 'tcp'", os.environ["MC_FORCE_TCP"])
            protocol = "tcp"
        elif protocol not in ("tcp", "rdma", ""):
            # Mooncake's usual build discovers its transports whatever the
            # string says; SGLang passes MOONCAKE_PROTOCOL through (efa,
            # nvlink, ascend...). kvferry has tcp and rdma: it takes what
            # the host offers, and says so once.
            log.warning("kvferry.mooncake: protocol %r is not one of kvferry's (tcp, rdma); using what this host "
                        "offers (rdma where a device is usable, else tcp). Set KVFERRY_PROTOCOL to choose.", protocol)
            protocol = "auto"
        try:
            host, port = _split_hostport(local_hostname)
        except ValueError as e:
            return self._fail(_lib.ERR_INVALID, f"initialize: local_hostname {local_hostname!r}: {e}")
        if not host:
            return self._fail(_lib.ERR_INVALID, f"initialize: local_hostname {local_hostname!r} has no host")
        opts = _lib.EngineOptions()
        opts.struct_size = ctypes.sizeof(opts)
        opts.host = host.encode()
        opts.protocol = protocol.encode()
        opts.port = port or 0
        if metadata_url:
            opts.metadata = metadata_url.encode()
        # The engine's default deadline also bounds submits that must refresh
        # a descriptor or connect, so it follows the sync deadline.
        opts.default_timeout_ms = self._ms(self._timeout_s)
        out = c_void_p()
        code = self._lib.kvf_engine_create(byref(opts), byref(out))
        if protocol == "rdma" and not strict:
            # SGLang and vLLM pass "rdma" whatever the host has. The engine
            # then takes "auto": rdma with peers elsewhere when a device is
            # usable here, tcp otherwise, as Mooncake falls back; and shm
            # with peers on this host (prefill and decode on one node),
            # which "rdma" itself would refuse. The first engine only
            # checked for a device.
            if code == _lib.OK:
                self._lib.kvf_engine_destroy(out)
                out = c_void_p()
            elif code == _lib.ERR_UNSUPPORTED:
                reason = self._lib.kvf_last_error().decode(errors="replace")
                log.warning("kvferry.mooncake: protocol 'rdma' is unavailable here (%s); falling back to tcp "
                            "(shm with peers on this host), as Mooncake falls back (set KVFERRY_PROTOCOL=rdma to "
                            "make this an error)", reason)
            if code in (_lib.OK, _lib.ERR_UNSUPPORTED):
                protocol = "auto"
                opts.protocol = protocol.encode()
                code = self._lib.kvf_engine_create(byref(opts), byref(out))
        if code != _lib.OK:
            msg = self._lib.kvf_last_error().decode(errors="replace")
            if code == _lib.ERR_UNSUPPORTED and "protocol" in msg:
                msg += (f"; protocol {protocol!r} is unavailable here (KVFERRY_PROTOCOL asks for it strictly): "
                        "unset it, or set KVFERRY_PROTOCOL=tcp")
            return self._fail(code, f"initialize: {msg}")
        self._engine = out.value
        self._name = _lib.read_string(self._lib.kvf_engine_name, self._engine)
        return 0

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """Mooncake's extended initialize: as :meth:`initialize`, with the
        metadata server's type named: "etcd" with "host:port[;host:port]"
        or "etcd://..." (segments found in that etcd cluster), "p2p" or any
        type with "P2PHANDSHAKE" (segments asked themselves); "redis" and
        "http" are a clear -1 (not supported)."""
        metadata_type = _str(metadata_type, "metadata_type")
        metadata_server = _str(metadata_server, "metadata_server")
        try:
            url = _metadata_url(metadata_server, metadata_type)
        except ValueError as e:
            return self._fail(_lib.ERR_UNSUPPORTED, f"initialize_ext: {e}")
        return self.initialize(local_hostname, url or P2PHANDSHAKE, protocol, device_name)

    def get_engine(self) -> "TransferEngine":
        """Mooncake returns its underlying C++ engine. kvferry has no
        separate object: this engine itself is returned, which is what code
        that calls its methods needs. It cannot stand in for Mooncake's C++
        engine: SGLang's HiCache with the Mooncake Store, which hands this
        object to ``MooncakeDistributedStore.setup`` to share one engine,
        fails there (pybind cannot cast it); run that store with an engine
        of its own (a different device name or protocol keeps SGLang from
        sharing)."""
        return self

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Mooncake's EFA warm-up: kvferry has no EFA transport, so there
        is nothing to warm up (0, as Mooncake without EFA answers)."""
        _str(segment_name, "segment_name")
        return 0

    def metrics_text(self) -> str:
        """kvferry extension: the engine's metrics in the Prometheus text
        format (see :func:`kvferry.register_prometheus` to serve them with
        the host process's own ``/metrics``)."""
        return _lib.read_growing_text(self._lib.kvf_metrics_text, self._require())

    def get_rpc_port(self) -> int:
        """The port peers reach this engine on (session id "host:port")."""
        self._require()
        return int(self._name.rsplit(":", 1)[1])

    def get_session_id(self) -> str:
        """kvferry extension: this engine's session id, "host:port"."""
        self._require()
        return self._name

    def last_error(self) -> Tuple[int, str]:
        """kvferry extension: (kvf_status code, message) of the last call of
        this thread that returned a failure; (0, "") when none did."""
        return getattr(self._tls, "err", (0, ""))

    def close(self) -> None:
        """kvferry extension: cancels batches still in flight, closes
        sessions and destroys the engine (managed buffers are unmapped).
        Returns once the engine no longer touches any memory. Idempotent;
        later calls raise RuntimeError."""
        self._closed = True
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if os.getpid() != self._pid:
            # A forked child: the Go runtime did not survive the fork, and
            # a call into it would hang; the parent owns the engine.
            return
        with self._lock:
            batches = list(self._batches.values())
            self._batches.clear()
            segments = list(self._segments.values())
            self._segments.clear()
            self._managed.clear()
        for b in batches:
            self._lib.kvf_batch_cancel(b.handle)
            self._lib.kvf_batch_free(b.handle)
        for s in segments:
            self._lib.kvf_close_segment(s)
        with self._raw_lock:  # destroy unmaps managed buffers: no raw copy meanwhile
            self._lib.kvf_engine_destroy(engine)
            with self._lock:
                self._ranges.clear()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter exit module globals may be gone; the process end
        # frees everything anyway.
        try:
            self.close()
        except Exception:
            pass

    # ----------------------------------------------------------------- memory

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers [buffer_addr, +capacity). 0, or -7 (overlaps a
        registered range), -1 (invalid: zero length, address below 4096, a
        GPU location without the CUDA driver)."""
        addr = _uint(buffer_addr, "buffer_addr")
        length = _uint(capacity, "capacity")
        loc = _str(location, "location")
        e = self._require()
        code = self._memory_code(self._lib.kvf_register_memory(e, addr, length, loc.encode()))
        if code == 0:
            self._track([addr], [length])
        return code

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the range starting at buffer_addr; returns once no copy
        into or out of it runs. 0, or -3 when nothing is registered there."""
        addr = _uint(buffer_addr, "buffer_addr")
        e = self._require()
        code = self._memory_code(self._lib.kvf_unregister_memory(e, addr))
        if code == 0:
            self._untrack([addr])
        return code

    def batch_register_memory(self, buffer_addresses: List[int], capacities: List[int],
                              location: str = "*") -> int:
        """Registers every range, all or none, in one library call."""
        addrs = _uint_array(buffer_addresses, "buffer_addresses")
        lens = _uint_array(capacities, "capacities")
        loc = _str(location, "location").encode()
        e = self._require()
        if len(addrs) != len(lens):
            return self._fail(_lib.ERR_INVALID, "batch_register_memory: buffer_addresses and capacities "
                                                "have different sizes")
        if not addrs:
            return 0
        ranges = (_lib.MemoryRange * len(addrs))()
        for i, (a, n) in enumerate(zip(addrs, lens)):
            r = ranges[i]
            r.addr = a
            r.len = n
            r.location = loc
        code = self._memory_code(self._lib.kvf_register_memory_batch(e, ranges, len(addrs)))
        if code == 0:
            self._track(addrs, lens)
        return code

    def batch_unregister_memory(self, buffer_addresses: List[int]) -> int:
        """Unregisters every range by start address, all or none."""
        addrs = _uint_array(buffer_addresses, "buffer_addresses")
        e = self._require()
        if not addrs:
            return 0
        ptrs = (c_void_p * len(addrs))(*addrs)
        code = self._memory_code(self._lib.kvf_unregister_memory_batch(e, ptrs, len(addrs)))
        if code == 0:
            self._untrack(addrs)
        return code

    def allocate_managed_buffer(self, length: int) -> int:
        """Maps and registers length bytes owned by the engine; the address,
        or 0 on failure (also for length 0)."""
        n = _uint(length, "length")
        e = self._require()
        out = c_void_p()
        code = self._lib.kvf_alloc_buffer(e, n, b"*", byref(out))
        if code != _lib.OK:
            self._fail(code, self._err())
            return 0
        with self._lock:
            self._managed.add(out.value)
        self._track([out.value], [n])
        return out.value

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Unregisters and unmaps a buffer from allocate_managed_buffer. 0, or
        -1 when buffer_addr is not one (Mooncake's allocator would take any
        address)."""
        addr = _uint(buffer_addr, "buffer_addr")
        _uint(length, "length")
        e = self._require()
        # No raw copy runs while the buffer is unmapped and until its ranges
        # are forgotten.
        with self._raw_lock:
            code = self._lib.kvf_free_buffer(e, addr)
            if code == _lib.OK:
                with self._lock:
                    self._managed.discard(addr)
                    size = self._ranges.get(addr, 0)
                    # Freeing unregisters every range inside the buffer too.
                    for a in [a for a in self._ranges if addr <= a < addr + size]:
                        del self._ranges[a]
        if code != _lib.OK:
            return self._fail(code, self._err())
        return 0

    def _track(self, addrs: List[int], lens: List[int]) -> None:
        with self._lock:
            self._ranges.update(zip(addrs, lens))

    def _untrack(self, addrs: List[int]) -> None:
        with self._lock:
            for a in addrs:
                self._ranges.pop(a, None)

    def _inside(self, addr: int, n: int) -> bool:
        """Whether [addr, +n) lies in memory registered (or allocated) through
        this engine: the raw copies below touch nothing else, so a wrong
        address is an error, not a crash of the interpreter."""
        with self._lock:
            return any(a <= addr and addr + n <= a + ln for a, ln in self._ranges.items())

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: Union[bytes, bytearray, memoryview, str],
                              length: int) -> int:
        """Copies the first length bytes of src_ptr to dest_address (memory
        of this process). 0, or -1 when src_ptr is shorter than length."""
        dest = _uint(dest_address, "dest_address")
        n = _uint(length, "length")
        if isinstance(src_ptr, str):
            data: Union[bytes, bytearray, memoryview] = src_ptr.encode()
        elif isinstance(src_ptr, (bytes, bytearray, memoryview)):
            data = src_ptr
        else:
            raise TypeError(f"src_ptr: expected bytes or str, got {type(src_ptr).__name__}")
        if n > len(data):
            return self._fail(_lib.ERR_INVALID, f"write_bytes_to_buffer: length {n} > {len(data)} bytes given")
        if n == 0:
            return 0
        self._require()
        if isinstance(data, bytes):
            src = data
        else:
            src = bytes(memoryview(data)[:n])
        with self._raw_lock:  # memmove releases the GIL: no free may unmap dest meanwhile
            inside = self._inside(dest, n)
            if inside:
                ctypes.memmove(dest, src, n)
        if not inside:
            return self._fail(_lib.ERR_NOT_REGISTERED, f"write_bytes_to_buffer: [{dest:#x}, +{n}) is not memory "
                                                      "registered or allocated through this engine")
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """length bytes of this process's memory at source_address."""
        src = _uint(source_address, "source_address")
        n = _uint(length, "length")
        if not n:
            return b""
        self._require()
        with self._raw_lock:  # see write_bytes_to_buffer
            if self._inside(src, n):
                return ctypes.string_at(src, n)
        # Mooncake returns bytes here and has no error code: it would read
        # any address; a wrong one is refused instead of crashing.
        raise ValueError(f"read_bytes_from_buffer: [{src:#x}, +{n}) is not memory registered or "
                         "allocated through this engine")

    # --------------------------------------------------------------- sessions

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The lowest registered address of the peer (its cached descriptor),
        or 0 when it has none or cannot be reached."""
        name = _str(segment_name, "segment_name")
        self._require()
        seg = self._open(name)
        if seg is None:
            return 0
        addr = c_uint64()
        code = self._lib.kvf_segment_buffer(seg, 0, byref(addr), None)
        if code != _lib.OK:
            self._fail(code, self._err())
            return 0
        return addr.value

    def send_probe(self, peer_server_name: str) -> int:
        """Checks that the peer answers (fetches its descriptor once). 0; -102
        (socket) when it does not answer or refuses, -101 when its host does
        not resolve, -1 for a malformed name."""
        name = _str(peer_server_name, "peer_server_name")
        e = self._require()
        code = self._connect_check(name)
        if code != 0:
            return code
        seg = c_void_p()
        st = self._lib.kvf_open_segment(e, name.encode(), self._ms(min(self._timeout_s, 5.0)), byref(seg))
        if st != _lib.OK:
            self._fail(st, self._err())
            return MC_ERR_INVALID_ARGUMENT if st == _lib.ERR_INVALID else MC_ERR_SOCKET
        self._lib.kvf_close_segment(seg.value)
        return 0

    # -------------------------------------------------------------- transfers

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "", *, request_id: int = 0) -> int:
        """WRITEs length bytes from our buffer to the peer's address. 0, or
        -1 (reason in last_error()). Returns by the deadline (transfer
        timeout + 1 ns per byte) and leaves the memory untouched afterwards."""
        return self._sync(target_hostname, _KVF_OP_WRITE, [_uint(buffer, "buffer")],
                          [_uint(peer_buffer_address, "peer_buffer_address")], [_uint(length, "length")],
                          transport_hint, request_id)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "", *, request_id: int = 0) -> int:
        """READs length bytes of the peer's address into our buffer; as
        transfer_sync_write."""
        return self._sync(target_hostname, _KVF_OP_READ, [_uint(buffer, "buffer")],
                          [_uint(peer_buffer_address, "peer_buffer_address")], [_uint(length, "length")],
                          transport_hint, request_id)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
                      transport_hint: str = "", *, request_id: int = 0) -> int:
        """Mooncake's generic form of transfer_sync_read/write."""
        op = self._opcode(opcode)
        if notify is not None:
            return self._fail(_lib.ERR_UNSUPPORTED, "transfer_sync: notify is not supported by kvferry.mooncake")
        return self._sync(target_hostname, op, [_uint(buffer, "buffer")],
                          [_uint(peer_buffer_address, "peer_buffer_address")], [_uint(length, "length")],
                          transport_hint, request_id)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: List[int],
                                  peer_buffer_addresses: List[int], lengths: List[int],
                                  transport_hint: str = "", *, request_id: int = 0) -> int:
        """WRITEs every (buffer, peer address, length) in one library call. 0
        when all completed, else -1. Bounded like transfer_sync_write."""
        return self._sync(target_hostname, _KVF_OP_WRITE, buffers, peer_buffer_addresses, lengths,
                          transport_hint, request_id)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: List[int],
                                 peer_buffer_addresses: List[int], lengths: List[int],
                                 transport_hint: str = "", *, request_id: int = 0) -> int:
        """READs every entry in one library call; as batch_transfer_sync_write."""
        return self._sync(target_hostname, _KVF_OP_READ, buffers, peer_buffer_addresses, lengths,
                          transport_hint, request_id)

    def batch_transfer_sync(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
                            lengths: List[int], opcode: TransferOpcode,
                            notify: Optional[TransferNotify] = None, transport_hint: str = "", *,
                            request_id: int = 0) -> int:
        """Mooncake's generic form of batch_transfer_sync_read/write."""
        op = self._opcode(opcode)
        if notify is not None:
            return self._fail(_lib.ERR_UNSUPPORTED,
                              "batch_transfer_sync: notify is not supported by kvferry.mooncake")
        return self._sync(target_hostname, op, buffers, peer_buffer_addresses, lengths, transport_hint,
                          request_id)

    def batch_transfer_async_write(self, target_hostname: str, buffers: List[int],
                                   peer_buffer_addresses: List[int], lengths: List[int],
                                   transport_hint: str = "", *, request_id: int = 0) -> int:
        """Starts WRITEs of every entry; a batch id for
        get_batch_transfer_status, or 0 on failure."""
        return self._async(target_hostname, _KVF_OP_WRITE, buffers, peer_buffer_addresses, lengths,
                           transport_hint, request_id)

    def batch_transfer_async_read(self, target_hostname: str, buffers: List[int],
                                  peer_buffer_addresses: List[int], lengths: List[int],
                                  transport_hint: str = "", *, request_id: int = 0) -> int:
        """Starts READs of every entry; as batch_transfer_async_write."""
        return self._async(target_hostname, _KVF_OP_READ, buffers, peer_buffer_addresses, lengths,
                           transport_hint, request_id)

    def batch_transfer_async(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
                             lengths: List[int], opcode: TransferOpcode, transport_hint: str = "", *,
                             request_id: int = 0) -> int:
        """Mooncake's generic form of batch_transfer_async_read/write."""
        return self._async(target_hostname, self._opcode(opcode), buffers, peer_buffer_addresses, lengths,
                           transport_hint, request_id)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "", *, request_id: int = 0) -> int:
        """Starts one WRITE; a batch id for transfer_check_status (or
        get_batch_transfer_status), 0 on failure."""
        return self._async(target_hostname, _KVF_OP_WRITE, [_uint(buffer, "buffer")],
                           [_uint(peer_buffer_address, "peer_buffer_address")], [_uint(length, "length")],
                           transport_hint, request_id)

    def get_batch_transfer_status(self, batch_ids: List[int]) -> int:
        """Waits for every batch: 0 when all completed (each is freed), -1
        when one failed, passed its deadline or is unknown; then every batch
        of the list not yet completed is canceled (returning once the engine
        stopped touching its memory) and freed, as Mooncake frees them."""
        ids = list(_uint_array(batch_ids, "batch_ids"))
        self._require()
        failed = False
        done: List[int] = []
        for bid in ids:
            with self._lock:
                b = self._batches.get(bid)
            if b is None:
                failed = self._fail(_lib.ERR_INVALID, f"get_batch_transfer_status: unknown batch id {bid:#x}") < 0
                break
            remaining_ms = max(0, int((b.deadline - time.monotonic()) * 1000))
            code = self._lib.kvf_batch_wait(b.handle, min(remaining_ms, _INT32_MAX))
            if code == _lib.OK:
                self._drop_batch(bid, cancel=False)
                done.append(bid)
                continue
            self._fail(code, self._err())
            self._evict_on(code, b)
            failed = True
            break
        if failed:
            for bid in ids:
                if bid not in done:
                    self._drop_batch(bid, cancel=True)
            return -1
        return 0

    def transfer_check_status(self, batch_id: int) -> int:
        """Polls the first task of a batch without blocking: 1 completed
        (the batch is freed), -1 failed or unknown id (freed), -2 deadline
        passed (canceled, then freed), 0 still in flight."""
        bid = _uint(batch_id, "batch_id")
        self._require()
        with self._lock:
            b = self._batches.get(bid)
        if b is None:
            return self._fail(_lib.ERR_INVALID, f"transfer_check_status: unknown batch id {bid:#x}")
        st = _lib.TaskStatus()
        code = self._lib.kvf_batch_status(b.handle, 0, byref(st))
        if code != _lib.OK:
            self._fail(code, self._err())
            self._drop_batch(bid, cancel=True)
            return -1
        if st.state == _TASK_COMPLETED:
            self._drop_batch(bid, cancel=False)
            return 1
        if st.state >= _TASK_FAILED:
            self._fail(st.error, self._task_error(b.handle, 0))
            self._evict_on(st.error, b)
            self._drop_batch(bid, cancel=False)
            return -1
        if time.monotonic() > b.deadline:
            self._fail(_lib.ERR_TIMEOUT, "transfer_check_status: deadline passed; the transfer was canceled")
            self._drop_batch(bid, cancel=True)
            return -2
        return 0

    # ------------------------------------------------------------------ abort

    def abort(self, request_id: int, initiators: Union[str, Sequence[str]] = (),
              timeout: Optional[float] = None) -> int:
        """kvferry extension, owner side: aborts request_id. From the call on
        every access of it to our memory is refused; each named initiator
        (session ids "host:port") is told and its transfers of it end
        failed (-1, last_error() code ERR_ABORTED). Returns 0 when safe (no
        further byte of the request can touch our memory: its slots may be
        reused at once), -1 when safety was not reached by timeout seconds
        (None: the engine default), with the reason in last_error(). An
        aborted request id cannot be used again: take a new one.

        An abort stops only the transfers that carry request_id (the
        ``request_id=`` keyword of the transfer calls). Transfers without
        one, which is every transfer of code written for Mooncake (SGLang's
        and vLLM's wrappers pass none), are not stopped by it: they are
        stopped only by :meth:`fence_memory` of their pages (or by
        unregistering the memory)."""
        rid = _uint(request_id, "request_id")
        names = [initiators] if isinstance(initiators, (str, bytes)) else list(initiators)
        enc = [_str(n, "initiators").encode() for n in names]
        e = self._require()
        arr = (c_char_p * max(1, len(enc)))(*enc)
        ms = _lib.TIMEOUT_DEFAULT if timeout is None else self._ms(timeout)
        res = _lib.AbortResult()
        res.struct_size = ctypes.sizeof(res)
        code = self._lib.kvf_abort(e, rid, arr, len(enc), ms, byref(res))
        if code != _lib.OK or not res.safe:
            return self._fail(code if code != _lib.OK else _lib.ERR_TIMEOUT, self._err())
        return 0

    def fence_memory(self, addrs: List[int], lengths: List[int], timeout: Optional[float] = None) -> int:
        """kvferry extension, owner side: fences the ranges [addrs[i],
        +lengths[i]) of our registered memory. From the call on every
        transfer into or out of them planned before it is refused, whatever
        its request id (none included) and whichever peer sent it, and
        whatever that peer does next (slow, paused, retrying); transfers
        planned after the call pass. Returns 0 when safe: no such transfer
        can write into or read from those bytes any more, so the pages may
        be freed and handed to the next request at once. Returns -1 when
        safety was not reached by ``timeout`` seconds (None: the engine
        default, the transfer timeout), logged as a WARNING with the
        reason, or for invalid arguments (lists of different sizes, no
        ranges, a zero length, a range outside memory registered here),
        logged as an ERROR; ``last_error()`` has the code and the reason.

        When decode should call it: before it frees (or reuses) the KV pages
        of a room that a prefill peer may still be writing, when that peer
        passes no request id, as SGLang's and vLLM's Mooncake wrappers do
        today: a request aborted, timed out or failed on the prefill side,
        or decode giving up on it, leaves writes of the room on the wire or
        queued in a paused or retrying prefill. Fence the room's page ranges
        (every layer's K and V pages, and its aux buffer), then free them.
        Tell the writer about pages only after the call returned, as a
        decode does when it hands them to a new room: its transfers into
        them are then planned after the fence and pass.

        How it differs from :meth:`abort`: ``abort(request_id)`` stops only
        the transfers that carry that request id, whatever memory they
        touch; transfers without a request id are stopped only by
        ``fence_memory`` of the memory they touch."""
        a = _uint_array(addrs, "addrs")
        n = _uint_array(lengths, "lengths")
        e = self._require()
        if len(a) != len(n):
            return self._fail(_lib.ERR_INVALID, f"fence_memory: {len(a)} addrs and {len(n)} lengths")
        count = len(a)
        pa = (c_uint64 * count).from_buffer(a) if count else None
        pl = (c_uint64 * count).from_buffer(n) if count else None
        ms = _lib.TIMEOUT_DEFAULT if timeout is None else self._ms(timeout)
        res = _lib.FenceResult()
        res.struct_size = ctypes.sizeof(res)
        res.safe = 0xFFFFFFFF  # the library writes 0 or 1 once the fence ran
        code = self._lib.kvf_fence_memory(e, pa, pl, count, ms, byref(res))
        if code == _lib.OK:
            return 0
        msg = self._err()
        if res.safe == 0:
            # Not safe is an outcome of the fence, not a failed call.
            return self._fail(code, msg, level=logging.WARNING)
        return self._fail(code, msg)

    # -------------------------------------------------------------- internals

    def _require(self) -> int:
        """The engine handle, or RuntimeError before initialize()/after close()."""
        e = self._engine
        if e is None:
            if self._closed:
                raise RuntimeError("kvferry.mooncake.TransferEngine is closed")
            raise RuntimeError("kvferry.mooncake.TransferEngine: call initialize() first (and check it returned 0)")
        if os.getpid() != self._pid:
            raise RuntimeError("kvferry.mooncake.TransferEngine: this process was forked after the engine was "
                               "created; the library does not survive fork: start workers with multiprocessing's "
                               "spawn or forkserver")
        return e

    @staticmethod
    def _ms(seconds: float) -> int:
        """Seconds as a library timeout: whole ms, at least 1, at most int32."""
        return max(1, min(_INT32_MAX, int(seconds * 1000)))

    @staticmethod
    def _opcode(opcode: object) -> int:
        """A TransferOpcode (or its int) as a kvf_op; TypeError otherwise."""
        try:
            op = TransferOpcode(operator.index(opcode))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TypeError(f"opcode: expected TransferOpcode, got {opcode!r}") from None
        return _KVF_OP_WRITE if op == TransferOpcode.Write else _KVF_OP_READ

    def _err(self) -> str:
        """This thread's kvf_last_error(), read right after the failed call."""
        return self._lib.kvf_last_error().decode(errors="replace")

    def _fail(self, code: int, message: str, level: int = logging.ERROR) -> int:
        """Records a failure for last_error(), logs it (ERROR unless level
        says otherwise), returns -1."""
        self._tls.err = (code, message)
        log.log(level, "%s", message)
        return -1

    def _memory_code(self, code: int) -> int:
        """A memory call's kvf_status as Mooncake's code (0, -7, -3 or -1)."""
        if code == _lib.OK:
            return 0
        self._fail(code, self._err())
        return _MEMORY_CODES.get(code, MC_ERR_INVALID_ARGUMENT)

    def _task_error(self, batch: int, index: int) -> str:
        """The message of a batch task's error."""
        try:
            return _lib.read_string(lambda h, b, c, n: self._lib.kvf_batch_task_error(h, index, b, c, n), batch)
        except KvferryError as e:
            return e.message

    def _connect_check(self, name: str) -> int:
        """Fails fast where Mooncake does: a refused TCP connection or an
        unresolvable host. The ZMQ control plane would instead retry in the
        background until the deadline. 0 when the check passed or could not
        decide (e.g. it timed out): the library decides then."""
        try:
            host, port = _split_hostport(name)
        except ValueError as e:
            return self._fail(_lib.ERR_INVALID, f"session {name!r}: {e}")
        if port is None:
            return self._fail(_lib.ERR_INVALID, f"session {name!r}: want \"host:port\"")
        try:
            with socket.create_connection((host, port), timeout=min(_CONNECT_CHECK_S, self._timeout_s)):
                pass
        except (socket.gaierror, UnicodeError, ValueError) as e:
            # UnicodeError: a label too long for IDNA; never raised to the
            # caller, who gets Mooncake's code.
            self._fail(_lib.ERR_UNREACHABLE, f"session {name!r}: host does not resolve: {e}")
            return MC_ERR_DNS
        except ConnectionRefusedError as e:
            self._fail(_lib.ERR_UNREACHABLE, f"session {name!r}: connection refused: {e}")
            return MC_ERR_SOCKET
        except OSError:
            pass
        return 0

    def _open(self, name: str) -> Optional[int]:
        """The cached segment handle of session name, opening it on first
        use; None on failure (recorded)."""
        seg = self._segments.get(name)
        if seg is not None:
            return seg
        e = self._require()
        with self._open_lock:
            seg = self._segments.get(name)
            if seg is not None:
                return seg
            if self._connect_check(name) != 0:
                return None
            out = c_void_p()
            code = self._lib.kvf_open_segment(e, name.encode(), self._ms(self._timeout_s), byref(out))
            if code != _lib.OK:
                self._fail(code, self._err())
                return None
            with self._lock:
                self._segments[name] = out.value
            return out.value

    def _evict(self, name: str, seg: int) -> None:
        """Drops a session that failed with a dead peer or connection, so the
        next call opens it again."""
        with self._lock:
            if self._segments.get(name) != seg:
                return
            del self._segments[name]
        self._lib.kvf_close_segment(seg)

    def _evict_on(self, code: int, b: _Batch) -> None:
        """Drops the session of a batch that failed with a dead peer, a broken
        connection or a stale descriptor, so the next call opens it again."""
        if code in _EVICT_CODES or code == _lib.ERR_STALE_KEY:
            self._evict(b.name, b.seg)

    def _arrays(self, buffers: Iterable[object], peers: Iterable[object],
                lengths: Iterable[object]) -> Optional[Tuple[array, array, array]]:
        """The three entry lists as array('Q') (TypeError for wrong types, as
        pybind11 raises before the call); None (recorded) when their sizes
        differ. Zero-length entries are left out: Mooncake completes them,
        they move nothing, and kvferry refuses zero-length requests."""
        src = _uint_array(buffers, "buffers")
        dst = _uint_array(peers, "peer_buffer_addresses")
        lens = _uint_array(lengths, "lengths")
        n = len(src)
        if len(dst) != n or len(lens) != n:
            self._fail(_lib.ERR_INVALID, "buffers, peer_buffer_addresses and lengths have different size")
            return None
        if n and 0 in lens:
            keep = [i for i in range(n) if lens[i]]
            src = array("Q", [src[i] for i in keep])
            dst = array("Q", [dst[i] for i in keep])
            lens = array("Q", [lens[i] for i in keep])
        return src, dst, lens

    @staticmethod
    def _pack(op: int, seg: int, src: array, dst: array, lens: array, request_id: int) -> ctypes.Array:
        """kvf_request structs for every entry in one array, filled by strided
        array.array assignments (C loops: no per-entry ctypes field access)."""
        n = len(src)
        words = array("Q", bytes(8 * _REQ_WORDS * max(n, 1)))
        if n:
            end = _REQ_WORDS * n
            words[0:end:_REQ_WORDS] = array("Q", [op << _OP_SHIFT]) * n
            words[1:end:_REQ_WORDS] = src
            words[2:end:_REQ_WORDS] = array("Q", [seg]) * n
            words[3:end:_REQ_WORDS] = dst
            words[4:end:_REQ_WORDS] = lens
            words[5:end:_REQ_WORDS] = array("Q", [request_id]) * n
        return (_lib.Request * max(n, 1)).from_buffer(words)

    def _prepare(self, target_hostname: object, op: int, buffers: Iterable[object], peers: Iterable[object],
                 lengths: Iterable[object], transport_hint: object,
                 request_id: object) -> Optional[Tuple[str, int, ctypes.Array, int, int]]:
        """Checks the arguments, opens (or finds) the session and packs the
        requests: (name, segment, requests, count, total bytes), or None with
        the failure recorded."""
        name = _str(target_hostname, "target_hostname")
        _str(transport_hint, "transport_hint")
        rid = _uint(request_id, "request_id")
        self._require()
        arrays = self._arrays(buffers, peers, lengths)
        if arrays is None:
            return None
        seg = self._open(name)
        if seg is None:
            return None
        src, dst, lens = arrays
        return name, seg, self._pack(op, seg, src, dst, lens, rid), len(src), sum(lens)

    def _sync(self, target_hostname: object, op: int, buffers: Iterable[object], peers: Iterable[object],
              lengths: Iterable[object], transport_hint: object, request_id: object) -> int:
        """A synchronous batch: 0, or -1 with the failure recorded."""
        p = self._prepare(target_hostname, op, buffers, peers, lengths, transport_hint, request_id)
        if p is None:
            return -1
        name, seg, reqs, n, total = p
        if n == 0:
            return 0
        # Mooncake's deadline: the transfer timeout plus 1 ns per byte.
        deadline = time.monotonic() + self._timeout_s + total * 1e-9
        code = self._lib.kvf_transfer_sync(self._require(), reqs, n, self._ms(deadline - time.monotonic()), None)
        if code == _lib.ERR_STALE_KEY:
            # The peer unregistered and registered a range again since we
            # fetched its descriptor. The engine does not refresh the
            # descriptor on this refusal (reported), so the session is closed
            # and opened again (a fresh fetch), and the batch is run once more
            # within the same deadline: Mooncake, which has no buffer keys,
            # accepts such transfers. Entries that completed the first time
            # are moved again, with the same bytes.
            self._evict(name, seg)
            seg2 = self._open(name)
            if seg2 is not None and deadline > time.monotonic():
                self._repoint(reqs, n, seg2)
                seg = seg2
                code = self._lib.kvf_transfer_sync(self._require(), reqs, n,
                                                   self._ms(deadline - time.monotonic()), None)
        if code == _lib.OK:
            return 0
        self._fail(code, self._err())
        if code in _EVICT_CODES or code == _lib.ERR_STALE_KEY:
            self._evict(name, seg)
        return -1

    @staticmethod
    def _repoint(reqs: ctypes.Array, n: int, seg: int) -> None:
        """Points every packed request at another segment handle."""
        words = (ctypes.c_uint64 * (_REQ_WORDS * n)).from_buffer(reqs)
        words[2:_REQ_WORDS * n:_REQ_WORDS] = [seg] * n

    def _async(self, target_hostname: object, op: int, buffers: Iterable[object], peers: Iterable[object],
               lengths: Iterable[object], transport_hint: object, request_id: object) -> int:
        """An asynchronous batch: its id (the kvf_batch handle), or 0 with the
        failure recorded."""
        p = self._prepare(target_hostname, op, buffers, peers, lengths, transport_hint, request_id)
        if p is None:
            return 0
        name, seg, reqs, n, total = p
        e = self._require()
        out = c_void_p()
        code = self._lib.kvf_batch_alloc(e, max(n, 1), byref(out))
        if code != _lib.OK:
            self._fail(code, self._err())
            return 0
        handle = out.value
        if n:
            code = self._lib.kvf_batch_submit(handle, reqs, n)
            if code != _lib.OK:
                self._fail(code, self._err())
                self._lib.kvf_batch_free(handle)
                if code in _EVICT_CODES or code == _lib.ERR_STALE_KEY:
                    self._evict(name, seg)
                return 0
        deadline = time.monotonic() + self._timeout_s + total * 1e-9
        with self._lock:
            self._batches[handle] = _Batch(handle, deadline, name, seg)
        return handle

    def _drop_batch(self, bid: int, cancel: bool) -> None:
        """Forgets a batch: cancels it first when asked (returns once its
        memory is untouched), then frees it."""
        with self._lock:
            b = self._batches.pop(bid, None)
        if b is None:
            return
        if cancel:
            self._lib.kvf_batch_cancel(b.handle)
        self._lib.kvf_batch_free(b.handle)
