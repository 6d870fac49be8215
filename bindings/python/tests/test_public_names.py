"""The package's public names, and what a Segment or Batch says once it (or
its engine) is closed: kvferry.__all__ is built from engine.__all__ and both
handles check through one helper, so these pin what users see."""

from __future__ import annotations

import pytest

import kvferry
from kvferry import _lib

PUBLIC = {
    "AbortResult", "AbortedError", "Batch", "BatchFullError", "Buffer", "BusyError", "CanceledError",
    "ConnectionBrokenError", "Engine", "EngineClosedError", "Event", "EventType", "FenceResult", "FencedError",
    "ForkError", "HandleError", "InternalError", "InvalidArgumentError", "KvferryError", "LibraryNotFound",
    "MemoryInUseError", "NoMemoryError", "NotRegisteredError", "Op", "OverlapError", "ProtocolError",
    "RefusedError", "RemoteRangeError", "Request", "Segment", "StaleKeyError", "Stats", "TaskState",
    "TaskStatus", "TimedOutError", "TransferFailedError", "TruncatedError", "UnauthenticatedError", "UnknownStatusError",
    "UnreachableError", "UnsupportedError", "__version__", "address_of", "error_for", "library_version",
    "PrometheusCollector", "PrometheusMirror", "register_prometheus",
}


def test_all_names_each_public_name_once() -> None:
    assert sorted(kvferry.__all__) == sorted(PUBLIC)


def test_star_import_binds_every_public_name_to_the_package_attribute() -> None:
    names: dict = {}
    exec("from kvferry import *", names)  # noqa: S102 - the import a user writes
    for name in PUBLIC:
        assert names[name] is getattr(kvferry, name), name


def test_closed_segment_and_freed_batch_say_so_and_a_closed_engine_says_it_first() -> None:
    e = kvferry.Engine()
    seg = e.open_segment(e.name)
    batch = e.batch(1)
    seg.close()
    batch.free()
    with pytest.raises(kvferry.HandleError) as info:
        seg.handle
    assert (info.value.code, info.value.message) == (_lib.ERR_HANDLE, f"kvferry.Segment {e.name}: the segment is closed")
    with pytest.raises(kvferry.HandleError) as info:
        batch.cancel()
    assert (info.value.code, info.value.message) == (_lib.ERR_HANDLE, "kvferry.Batch: the batch was freed")
    e.close()
    for use in (lambda: seg.handle, batch.cancel):
        with pytest.raises(kvferry.EngineClosedError) as info:
            use()
        assert info.value.message == f"kvferry.Engine {e.name}: the engine is closed"
