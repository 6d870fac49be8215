"""kvferry: a KV-cache transfer engine with safe abort, from Python.

The Pythonic API is :class:`Engine` (with :class:`Segment`, :class:`Batch`,
:class:`Request`, :class:`Buffer`); ``kvferry.mooncake.TransferEngine`` is a
drop-in for ``mooncake.engine.TransferEngine``. The library (libkvferry.so)
is loaded on first use, from ``$KVFERRY_LIBRARY``, the package folder, or the
system's loader; :class:`LibraryNotFound` lists where it looked.

Fork rule: once the library is loaded (the first Engine), start child
processes with multiprocessing's "spawn" or "forkserver" method, never plain
``fork``: the Go runtime inside the library does not survive fork(), and a
forked child calling it could hang (kvferry raises :class:`ForkError` there).
The environment (``KVFERRY_*``) is read when the library loads; set options
through Engine's keyword arguments instead.
"""

from ._lib import KvferryError, LibraryNotFound
from . import engine
from ._memory import address_of
from .metrics import PrometheusCollector, PrometheusMirror, register_prometheus
from .engine import (
    AbortedError,
    AbortResult,
    Batch,
    BatchFullError,
    Buffer,
    BusyError,
    CanceledError,
    ConnectionBrokenError,
    Engine,
    EngineClosedError,
    Event,
    EventType,
    FencedError,
    FenceResult,
    ForkError,
    HandleError,
    InternalError,
    InvalidArgumentError,
    MemoryInUseError,
    NoMemoryError,
    NotRegisteredError,
    Op,
    OverlapError,
    ProtocolError,
    RefusedError,
    RemoteRangeError,
    Request,
    Segment,
    StaleKeyError,
    Stats,
    TaskState,
    TaskStatus,
    TimedOutError,
    TransferFailedError,
    TruncatedError,
    UnauthenticatedError,
    UnknownStatusError,
    UnreachableError,
    UnsupportedError,
    error_for,
    library_version,
)

__version__ = "0.7.0"

# The public names: engine's, and those defined elsewhere in the package.
__all__ = ["LibraryNotFound", "PrometheusCollector", "PrometheusMirror", "__version__", "address_of", "register_prometheus"]
__all__ += engine.__all__
