"""Tests of kvferry's Pythonic API (kvferry.Engine and friends).

- two processes (spawn) move data both ways with every transfer API
  (transfer_sync with Request objects, write/read, write_many/read_many,
  Batch with tuples and with columns) and every kind of memory (int address,
  bytearray, alloc_buffer, NumPy when installed), checked byte for byte; a
  paused peer shows the bounded synchronous deadline and batch wait/cancel;
- the PD abort scenario: decode aborts a request mid-transfer from a prefill
  process, reuses the slots at once, and they keep the new pattern; the
  prefill's tasks end ABORTED and it gets the ABORTED event;
- fences by memory range: pages a peer wrote with no request id are fenced
  (every form of range the binding takes), the peer's next request into
  them lands; argument errors; a fence that is not safe is a result;
- grants and revoke, notifications and events (with the event fd), BusyError
  from a full event queue, stats;
- bad inputs give clear exceptions (or the library's codes) and never crash
  the interpreter, also on a closed engine.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import pickle
import select
import subprocess
import sys
import threading
import time
import types
from array import array
from typing import Any

import pytest

import kvferry
from kvferry import (
    AbortResult,
    Event,
    EventType,
    FenceResult,
    Op,
    Request,
    TaskState,
    TaskStatus,
)
from kvferry import _lib

from _helpers import (
    Child,
    assert_bytes_equal,
    child_expect,
    engine_pair,
    first_mismatch,
    pattern,
    pause,
    resume,
    wait_until,
)

KiB = 1024
MiB = 1024 * KiB


def _have_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------
# Two processes moving data both ways
# --------------------------------------------------------------------------

REG = 1 * MiB  # size of each region of the data peer


def _data_peer(conn: Any, with_numpy: bool) -> None:
    """The spawned peer: registers one region per kind of memory, then
    verifies, fills or initiates transfers on the parent's command."""
    import kvferry
    from kvferry import Op, Request

    with kvferry.Engine() as e:
        ba = bytearray(REG)
        raw = (ctypes.c_char * REG)()
        buf = e.alloc_buffer(REG)
        e.register(ba)
        e.register(ctypes.addressof(raw), REG)
        regions = {"bytearray": kvferry.address_of(ba), "alloc": buf.addr, "int": ctypes.addressof(raw)}
        views = {"bytearray": memoryview(ba), "alloc": buf.view(), "int": memoryview(raw).cast("B")}
        if with_numpy:
            import numpy as np
            arr = np.zeros(REG, dtype=np.uint8)
            regions["numpy"] = e.register(arr)
            views["numpy"] = memoryview(arr)
        conn.send(("ready", e.name, regions, os.getpid()))
        while True:
            msg = conn.recv()
            tag = msg[0]
            if tag == "verify":  # {kind: seed}: report the first mismatching byte of each
                conn.send(("verified", {k: first_mismatch(views[k], pattern(s, REG)) for k, s in msg[1].items()}))
            elif tag == "fill":
                for k, s in msg[1].items():
                    views[k][:] = pattern(s, REG)
                conn.send(("filled",))
            elif tag == "initiate":
                # The child as initiator: WRITE into the parent's dst, READ its src.
                parent, dst, src, n, wseed, rseed = msg[1:]
                views["alloc"][:n] = pattern(wseed, n)
                with e.open_segment(parent, timeout=10) as seg:
                    st = e.transfer_sync([Request(Op.WRITE, buf.addr, seg, dst, n, 77)], timeout=10)
                    assert st[0].ok and st[0].transferred == n, st
                    with e.batch(4) as b:
                        quarter = n // 4
                        b.submit([(Op.READ, regions["bytearray"] + i * quarter, seg, src + i * quarter, quarter, 78)
                                  for i in range(4)])
                        assert b.wait(10)
                conn.send(("initiated", first_mismatch(views["bytearray"][:n], pattern(rseed, n))))
            elif tag == "stop":
                conn.send(("stopped",))
                return
            else:
                raise AssertionError(f"unknown command {tag}")


def test_two_processes_both_ways_every_api() -> None:
    with_numpy = _have_numpy()
    with Child(_data_peer, with_numpy) as child, kvferry.Engine() as e:
        name, regions, pid = child.expect("ready")
        src = e.alloc_buffer(4 * REG)                  # engine-owned memory
        dst = bytearray(4 * REG)                       # the caller's memory, buffer protocol
        dst_addr = e.register(dst)
        with e.open_segment(name, timeout=10) as seg:
            # The peer's descriptor lists every region it registered.
            listed = dict(seg.buffers())
            for kind, addr in regions.items():
                assert listed.get(addr) == REG, (kind, listed)
            assert seg.name == name

            # WRITE into every region, each with another API.
            seeds = {"bytearray": 11, "alloc": 12, "int": 13, "numpy": 14}
            for i, kind in enumerate(["bytearray", "alloc", "int", "numpy"]):
                if kind in regions:
                    src.write(pattern(seeds[kind], REG), i * REG)
            part = REG // 16
            sts = e.transfer_sync([Request(Op.WRITE, src.addr + j * part, seg, regions["bytearray"] + j * part, part,
                                           1) for j in range(16)], timeout=10)
            assert [s.state for s in sts] == [TaskState.COMPLETED] * 16
            assert all(s.transferred == part for s in sts)
            page = 4 * KiB
            e.write_many(seg, [src.addr + REG + j * page for j in range(REG // page)],
                         [regions["alloc"] + j * page for j in range(REG // page)], page, request_id=2, timeout=10)
            with e.batch(8) as b:
                idx = b.submit([(Op.WRITE, src.addr + 2 * REG + j * (REG // 4), seg,
                                 regions["int"] + j * (REG // 4), REG // 4, 3) for j in range(4)])
                assert list(idx) == [0, 1, 2, 3] and len(b) == 4
                assert b.wait(10) is True
                assert all(s.ok and s.transferred == REG // 4 for s in b.statuses())
                assert b.status(3).state == TaskState.COMPLETED and b.task_error(3) == ""
            if "numpy" in regions:
                st = e.write(seg, src.addr + 3 * REG, regions["numpy"], REG, request_id=4, timeout=10)
                assert st == TaskStatus(TaskState.COMPLETED, 0, REG)
            child.send("verify", {k: seeds[k] for k in regions})
            (mismatch,) = child.expect("verified")
            assert mismatch == {k: -1 for k in regions}, "WRITEs did not land byte for byte"

            # READ every region back after the peer filled it anew.
            rseeds = {"bytearray": 21, "alloc": 22, "int": 23, "numpy": 24}
            child.send("fill", {k: rseeds[k] for k in regions})
            child.expect("filled")
            e.read_many(seg, [dst_addr + j * page for j in range(REG // page)],
                        [regions["bytearray"] + j * page for j in range(REG // page)], page, timeout=10)
            with e.batch(16) as b:
                b.submit_many(Op.READ, seg, [dst_addr + REG + j * part for j in range(16)],
                              [regions["alloc"] + j * part for j in range(16)], part, request_id=5)
                assert b.wait(10)
            e.transfer_sync([Request(Op.READ, dst_addr + 2 * REG, seg, regions["int"], REG, 6)], timeout=10)
            if "numpy" in regions:
                e.read(seg, dst_addr + 3 * REG, regions["numpy"], REG, timeout=10)
            for i, kind in enumerate(["bytearray", "alloc", "int", "numpy"]):
                if kind in regions:
                    assert_bytes_equal(memoryview(dst)[i * REG:(i + 1) * REG], pattern(rseeds[kind], REG),
                                       f"READ of the peer's {kind} region")

            # The other way: the peer initiates into our memory.
            src.write(pattern(32, REG), 0)
            child.send("initiate", e.name, dst_addr, src.addr, REG, 31, 32)
            (read_mismatch,) = child.expect("initiated")
            assert read_mismatch == -1, "the peer's READ of our memory differs"
            assert_bytes_equal(memoryview(dst)[:REG], pattern(31, REG), "the peer's WRITE into our memory")
            stats = e.stats()
            assert stats.owner_bytes_in >= REG and stats.owner_bytes_out >= REG

            # A paused peer: a synchronous WRITE ends TIMEOUT by its deadline
            # (plus a bounded margin), a batch wait returns False, cancel ends it.
            pause(pid)
            try:
                t0 = time.monotonic()
                with pytest.raises(kvferry.TimedOutError) as ei:
                    e.write(seg, src.addr, regions["bytearray"], REG, request_id=8, timeout=0.3)
                took = time.monotonic() - t0
                assert 0.29 <= took < 3.0, f"synchronous WRITE to a paused peer took {took:.3f} s for 0.3 s"
                assert isinstance(ei.value, TimeoutError) and ei.value.code == _lib.ERR_TIMEOUT
                assert ei.value.statuses[0].state == TaskState.TIMEOUT
                b = e.batch(2)
                b.submit([(Op.WRITE, src.addr, seg, regions["alloc"], REG, 9)])
                assert b.wait(0.2) is False
                assert not b.statuses()[0].final
                with pytest.raises(kvferry.BusyError):
                    b.free()  # refused while the task is in flight
                b.cancel()
                assert b.statuses()[0].state == TaskState.CANCELED
                with pytest.raises(kvferry.CanceledError) as ci:
                    b.wait(1)
                assert ci.value.statuses[0].state == TaskState.CANCELED
                assert b.wait(1, check=False) is True
                b.free()
                b.free()  # idempotent
            finally:
                resume(pid)
            # The peer works again.
            src.write(pattern(41, REG), 0)
            e.write(seg, src.addr, regions["bytearray"], REG, request_id=10, timeout=10)
            child.send("verify", {"bytearray": 41})
            assert child.expect("verified")[0] == {"bytearray": -1}
        child.send("stop")
        child.expect("stopped")
        child.join()


# --------------------------------------------------------------------------
# PD abort from Python
# --------------------------------------------------------------------------

SLOT = 8 * MiB         # decode's KV slots of one request
LAYERS = 32            # the request: one WRITE per layer...
LAYER = SLOT // LAYERS
OLD_SEED, NEW_SEED, NEXT_SEED = 101, 202, 303


def _prefill(conn: Any, decode_name: str, slot_addr: int, rid: int) -> None:
    """The prefill process: writes request rid into decode's slots (one
    batch of LAYERS WRITEs), and keeps rewriting it until its tasks end
    ABORTED, so that the abort always strikes while the request is being
    written, however slow the machine; then reports how it ended and the
    events it got."""
    import kvferry
    from kvferry import EventType, Op, TaskState

    with kvferry.Engine() as e:
        src = e.alloc_buffer(SLOT)
        src.write(pattern(OLD_SEED, SLOT))
        seg = e.open_segment(decode_name, timeout=10)
        conn.send(("ready", e.name))
        child_expect(conn, "go")
        steps, last = 0, None
        deadline = time.monotonic() + 30
        while last is None:
            assert time.monotonic() < deadline, "the request was never aborted"
            with e.batch(LAYERS) as b:
                b.submit_many(Op.WRITE, seg, [src.addr + i * LAYER for i in range(LAYERS)],
                              [slot_addr + i * LAYER for i in range(LAYERS)], LAYER, request_id=rid)
                b.wait(10, check=False)
                sts = b.statuses()
            steps += 1
            if any(s.state == TaskState.ABORTED for s in sts):
                last = sts
            else:
                assert all(s.ok for s in sts), sts
            if steps == 1:
                conn.send(("writing",))  # the request landed once and is being rewritten: abort now
        # A later submit of the request ends ABORTED at once (tombstone).
        try:
            e.write_many(seg, [src.addr], [slot_addr], [LAYER], request_id=rid, timeout=5)
            later = "COMPLETED"
        except kvferry.AbortedError as err:
            later = err.statuses[0].state.name
        events = []
        t_end = time.monotonic() + 10
        while not any(ev.type == EventType.ABORTED for ev in events) and time.monotonic() < t_end:
            events += e.poll_events(timeout=1)
        conn.send(("ended", [tuple(s) for s in last], steps, later,
                   [(int(ev.type), ev.peer, ev.request_id, ev.generation) for ev in events],
                   e.stats().tasks_aborted))
        # The next request writes the reused slots normally.
        rid2, seed = child_expect(conn, "again")
        src.write(pattern(seed, SLOT))
        e.write_many(seg, [src.addr + i * LAYER for i in range(LAYERS)],
                     [slot_addr + i * LAYER for i in range(LAYERS)], LAYER, request_id=rid2, timeout=10)
        seg.close()
        conn.send(("written",))


def test_pd_abort_mid_transfer_then_reuse() -> None:
    rid = 7001
    old, new = pattern(OLD_SEED, SLOT), pattern(NEW_SEED, SLOT)
    with kvferry.Engine() as decode:
        slots = bytearray(SLOT)
        slot_addr = decode.register(slots)
        view = memoryview(slots)
        with Child(_prefill, decode.name, slot_addr, rid) as prefill:
            (prefill_name,) = prefill.expect("ready")
            prefill.send("go")
            prefill.expect("writing")
            # Data is flowing: the whole request landed once (and is being rewritten).
            assert_bytes_equal(view, old, "the request's first pass before the abort")
            t0 = time.monotonic()
            res = decode.abort(rid, [prefill_name], timeout=5)
            took = time.monotonic() - t0
            assert isinstance(res, AbortResult)
            assert res.safe and res.generation == 1 and res.reason == "" and res.code == 0, res
            view[:] = new  # reuse the slots at once, as a decode server frees KV pages
            (last, steps, later, events, tasks_aborted) = prefill.expect("ended")
            states = [TaskState(s[0]) for s in last]
            assert TaskState.ABORTED in states, states
            assert set(states) <= {TaskState.COMPLETED, TaskState.ABORTED}, states
            for s in last:
                if s[0] == TaskState.ABORTED:
                    assert s[1] == _lib.ERR_ABORTED
            assert later == "ABORTED"
            assert (int(EventType.ABORTED), decode.name, rid, 1) in events, events
            assert tasks_aborted >= 1
            # Slices of the old request cut off by the abort must never land:
            # give stragglers time to (wrongly) arrive, then check every byte.
            time.sleep(0.05)
            assert_bytes_equal(view, new, f"reused slots after a safe abort ({steps} steps written, "
                                          f"abort took {took * 1e3:.1f} ms)")
            st = decode.stats()
            assert st.aborts_safe == 1 and st.aborts_not_safe == 0
            # The next request (a new id, as SGLang's rooms are) uses the slots.
            prefill.send("again", rid + 1, NEXT_SEED)
            prefill.expect("written")
            assert_bytes_equal(view, pattern(NEXT_SEED, SLOT), "the next request's WRITE into the reused slots")
            prefill.join()
        decode.unregister(slots)


# --------------------------------------------------------------------------
# Fences by memory range (two engines of this process)
# --------------------------------------------------------------------------

def test_fence_then_the_next_request_into_the_pages_lands() -> None:
    """The owner fences pages the initiator wrote with no request id (as
    SGLang's and vLLM's Mooncake wrappers write): each fence is safe at the
    next epoch and tells the initiator; once the initiator applied it, its
    next WRITE into the same pages, planned after the fence, lands. Every
    form of range the binding takes names the right bytes (a range outside
    registered memory would be refused)."""
    with engine_pair() as (owner, init, seg):
        kv = bytearray(4 * MiB)
        kv_addr = owner.register(kv)
        view = memoryview(kv)
        own_buf = owner.alloc_buffer(MiB)
        src = init.alloc_buffer(4 * MiB)
        src.write(pattern(1, 4 * MiB))
        init.write(seg, src, kv_addr, 4 * MiB)  # request id 0
        assert_bytes_equal(view, pattern(1, 4 * MiB), "the first WRITE")

        forms = [
            [(kv_addr, MiB)],                                 # (address, length)
            [(kv_addr, 4096), (kv_addr + 2 * MiB, 8192)],     # several
            kv,                                               # a registered object, whole
            [(kv, 64 * KiB)],                                 # its first bytes
            own_buf,                                          # a Buffer from alloc_buffer
            [own_buf, (own_buf, 4096)],                       # Buffers in a list
        ]
        for epoch, ranges in enumerate(forms, start=1):
            res = owner.fence(ranges, timeout=5)
            assert isinstance(res, FenceResult)
            assert res.safe and res.epoch == epoch and res.reason == "" and res.code == 0, (ranges, res)
            assert res.peers_told >= 1 and res.peers_acked <= res.peers_told and res.peers_cut == 0, res
        res = owner.fence_many([kv_addr + i * 64 * KiB for i in range(64)], 4096, timeout=5)
        assert res.safe and res.epoch == len(forms) + 1, res
        res = owner.fence_many(array("Q", [kv_addr, kv_addr + MiB]), [MiB, 3 * MiB])
        assert res.safe and res.epoch == len(forms) + 2, res
        fences = len(forms) + 2

        # The initiator acknowledges a notice once it applied it: from then
        # on its transfers carry the new epoch.
        wait_until(lambda: owner.stats().fence_acks >= fences, 10, "the initiator acknowledged every fence")
        st = owner.stats()
        assert st.fences_safe == fences and st.fences_not_safe == 0 and st.fence_epoch == fences, st
        assert st.fence_refused == 0, st
        assert init.stats().fences_received >= fences

        # The next request: a WRITE with no request id into the same pages.
        src.write(pattern(2, 4 * MiB))
        init.write(seg, src, kv_addr, 4 * MiB)
        assert_bytes_equal(view, pattern(2, 4 * MiB), "the next request's WRITE into the fenced pages")
        init.write_many(seg, [src.addr], [own_buf.addr], MiB)
        assert own_buf.read(16) == pattern(2, 16)
        assert owner.stats().fence_refused == 0
        view.release()
        owner.unregister(kv)


def test_fence_arguments_are_checked() -> None:
    """Bad ranges raise (from Python, or the library's own status with a
    message naming the range); nothing is fenced by a call that raised."""
    with kvferry.Engine() as e:
        mem = bytearray(64 * KiB)
        base = e.register(mem)
        unreg = (ctypes.c_char * (64 * KiB))()
        ua = ctypes.addressof(unreg)

        with pytest.raises(kvferry.NotRegisteredError, match="range 1") as ei:
            e.fence([(base, 4096), (ua, 4096)])
        assert ei.value.code == _lib.ERR_NOT_REGISTERED and "kvf_fence_memory" in ei.value.message
        with pytest.raises(kvferry.NotRegisteredError):
            e.fence([(base + 60 * KiB, 8 * KiB)])  # runs past the registration
        with pytest.raises(kvferry.NotRegisteredError):
            e.fence(unreg)
        with pytest.raises(kvferry.InvalidArgumentError, match="no ranges"):
            e.fence([])
        with pytest.raises(kvferry.InvalidArgumentError, match="range 1 length is 0"):
            e.fence_many([base, base + 4096], [4096, 0])
        with pytest.raises(kvferry.InvalidArgumentError, match="first page"):
            e.fence_many([16], [4096])
        with pytest.raises(kvferry.InvalidArgumentError, match="KVF_FENCE_RANGES_MAX"):
            e.fence_many([base] * (_lib.FENCE_RANGES_MAX + 1), 64)
        with pytest.raises(ValueError, match="range 0: length 0"):
            e.fence([(base, 0)])
        with pytest.raises(ValueError):
            e.fence([(base, 4096)], timeout=0)
        with pytest.raises(TypeError, match="needs a length"):
            e.fence([base])
        with pytest.raises(TypeError, match="range 1"):
            e.fence([(base, 4096), "text"])
        with pytest.raises(TypeError):
            e.fence([(base, 4096, 1)])
        with pytest.raises(TypeError):
            e.fence_many(base, 4096)
        with pytest.raises(ValueError):
            e.fence_many([base, base], [4096])  # columns of different lengths
        st = e.stats()
        assert st.fence_epoch == 0 and st.fences_safe == 0 and st.fences_not_safe == 0, st
        assert e.fence([(base, 4096)], timeout=1).epoch == 1
        e.unregister(mem)
    with pytest.raises(kvferry.EngineClosedError):
        e.fence([(base, 4096)])


class _NotSafeLibrary:
    """The library with kvf_fence_memory answering "not safe" as it does at
    a deadline (safe written as 0, KVF_ERR_TIMEOUT, a reason): a real one
    needs a copy stuck past the deadline."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.reason = b"kvf_fence_memory: fence of 1 ranges: not safe: copies still in progress at the deadline"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def kvf_fence_memory(self, engine: Any, addrs: Any, lengths: Any, n: int, ms: int, out: Any) -> int:
        res = ctypes.cast(out, ctypes.POINTER(_lib.FenceResult)).contents
        res.safe, res.epoch, res.peers_told, res.peers_acked, res.peers_cut = 0, 7, 2, 1, 0
        return _lib.ERR_TIMEOUT

    def kvf_last_error(self) -> bytes:
        return self.reason


def test_a_fence_that_is_not_safe_is_a_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvferry.engine as kengine

    with kvferry.Engine() as e:
        mem = bytearray(4096)
        base = e.register(mem)
        fake = _NotSafeLibrary(_lib.lib())
        monkeypatch.setattr(kengine, "_L", lambda: fake)
        res = e.fence([(base, 4096)], timeout=1)
        assert res == FenceResult(False, 7, 2, 1, 0, fake.reason.decode(), _lib.ERR_TIMEOUT), res
        monkeypatch.undo()
        e.unregister(mem)


# --------------------------------------------------------------------------
# Grants, notifications, events, stats (two engines of this process)
# --------------------------------------------------------------------------

def test_grant_and_revoke() -> None:
    with engine_pair() as (owner, init, seg):
        mem = bytearray(MiB)
        base = owner.register(mem)
        src = init.alloc_buffer(MiB)
        src.write(pattern(1, MiB))
        R = 3001
        gid = owner.grant(init.name, R, [(base, 64 * KiB)])
        assert gid != 0
        init.write(seg, src, base, 64 * KiB, request_id=R, timeout=10)
        assert_bytes_equal(memoryview(mem)[:64 * KiB], pattern(1, MiB)[:64 * KiB], "WRITE inside the grant")
        before = owner.stats().owner_refused
        with pytest.raises(kvferry.RefusedError) as ei:  # outside the grant
            init.write(seg, src.addr + 64 * KiB, base + 64 * KiB, 4 * KiB, request_id=R, timeout=10)
        assert ei.value.code == _lib.ERR_REFUSED and ei.value.statuses[0].state == TaskState.FAILED
        with pytest.raises(kvferry.RefusedError):  # straddling its end
            init.write(seg, src.addr + 60 * KiB, base + 60 * KiB, 8 * KiB, request_id=R, timeout=10)
        assert mem[64 * KiB:128 * KiB] == bytes(64 * KiB), "a refused WRITE landed"
        assert owner.stats().owner_refused >= before + 2
        # Another initiator's grant lets this one write nothing of its request.
        other = owner.grant("127.0.0.1:1", R + 1, [(base, 64 * KiB)])
        with pytest.raises(kvferry.RefusedError):
            init.write(seg, src.addr, base, 4 * KiB, request_id=R + 1, timeout=10)
        owner.revoke(other, timeout=1)
        # Request ids without grants still write anywhere registered.
        init.write(seg, src.addr + 64 * KiB, base + 64 * KiB, 4 * KiB, request_id=R + 2, timeout=10)
        # Revoked: closed to the request; a second revoke is invalid.
        owner.revoke(gid, timeout=5)
        src.write(pattern(2, 64 * KiB))
        with pytest.raises(kvferry.RefusedError):
            init.write(seg, src.addr, base, 64 * KiB, request_id=R, timeout=10)
        assert_bytes_equal(memoryview(mem)[:64 * KiB], pattern(1, MiB)[:64 * KiB], "after revoke")
        with pytest.raises(kvferry.InvalidArgumentError):
            owner.revoke(gid, timeout=5)
        # A Buffer is a range too; malformed ranges are refused in Python.
        owner_buf = owner.alloc_buffer(64 * KiB)
        assert owner.grant(seg.engine.name, R + 3, [owner_buf]) > gid
        with pytest.raises(TypeError):
            owner.grant(init.name, R + 4, [base])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            owner.grant(42, R + 4, [(base, 1)])  # type: ignore[arg-type]
        # Refusals are not aborts: the initiator got no event.
        assert init.poll_events(0) == []


def test_notify_events_and_event_fd() -> None:
    with engine_pair() as (owner, init, seg):
        fd = owner.event_fd()
        assert fd >= 0 and owner.event_fd() == fd
        assert select.select([fd], [], [], 0)[0] == [], "event fd readable before any event"
        assert owner.poll_events(0) == []

        # A notification sent after a WRITE completed arrives after its bytes.
        mem = bytearray(64 * KiB)
        base = owner.register(mem)
        src = init.alloc_buffer(64 * KiB)
        src.write(pattern(5, 64 * KiB))
        init.write(seg, src, base, 64 * KiB, request_id=4001, timeout=10)
        seg.notify(4001, b"hello")
        init.notify(seg, 4002, bytearray(b"x" * 64))  # the maximum, any bytes-like
        seg.notify(4003)  # empty
        assert select.select([fd], [], [], 5)[0] == [fd], "event fd not readable after notifications"
        evs = owner.poll_events(timeout=5, max=2)
        assert evs == [Event(EventType.NOTIFY, init.name, 4001, 0, b"hello"),
                       Event(EventType.NOTIFY, init.name, 4002, 0, b"x" * 64)]
        assert bytes(mem) == pattern(5, 64 * KiB)
        assert owner.poll_events(timeout=5) == [Event(EventType.NOTIFY, init.name, 4003, 0, b"")]
        assert select.select([fd], [], [], 0)[0] == [], "event fd still readable after every event was taken"
        with pytest.raises(ValueError):
            seg.notify(4004, b"y" * 65)
        with pytest.raises(TypeError):
            seg.notify(4004, "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            owner.poll_events(0, max=0)

        # An abort reaches the initiator as an ABORTED event, on its own fd.
        ifd = init.event_fd()
        res = owner.abort(4001, [seg.engine.name], timeout=5)
        assert res.safe and res.generation == 1
        assert select.select([ifd], [], [], 5)[0] == [ifd]
        assert init.poll_events(timeout=5) == [Event(EventType.ABORTED, owner.name, 4001, 1, b"")]
        # Aborting again bumps the generation.
        assert owner.abort(4001, [init.name], timeout=5).generation == 2
        assert init.poll_events(timeout=5)[0].generation == 2
        st = owner.stats()
        assert st.aborts_safe == 2 and st.tombstones == 1
        # On tcp a safe abort does not wait for ACKs: they follow.
        wait_until(lambda: owner.stats().abort_acks == 2, 5, "both ABORT_ACKs counted")
        assert init.stats().aborts_received >= 2


def _small_queue_peer(conn: Any) -> None:
    """A peer whose event queue holds 2 events (KVFERRY_EVENT_QUEUE, which
    the test set in the environment this process was started with)."""
    assert os.environ.get("KVFERRY_EVENT_QUEUE") == "2"
    import kvferry

    with kvferry.Engine() as e:
        conn.send(("ready", e.name))
        child_expect(conn, "drain")
        conn.send(("events", [(int(ev.type), ev.request_id, ev.data) for ev in e.poll_events(timeout=1, max=8)]))
        child_expect(conn, "stop")


def test_notify_busy_when_the_peer_queue_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Go runtime sees only the environment a process was started with
    # (not even os.environ changes made before the library loads), so the
    # variable is set here, before the child is spawned.
    monkeypatch.setenv("KVFERRY_EVENT_QUEUE", "2")
    with Child(_small_queue_peer) as child, kvferry.Engine() as e:
        monkeypatch.delenv("KVFERRY_EVENT_QUEUE")
        (name,) = child.expect("ready")
        with e.open_segment(name, timeout=10) as seg:
            seg.notify(1, b"a")
            seg.notify(2, b"b")
            with pytest.raises(kvferry.BusyError) as ei:
                seg.notify(3, b"c")
            assert ei.value.code == _lib.ERR_BUSY
            child.send("drain")
            (events,) = child.expect("events")
            assert events == [(int(EventType.NOTIFY), 1, b"a"), (int(EventType.NOTIFY), 2, b"b")]
            seg.notify(3, b"c")  # room again
        child.send("stop")
        child.join()


def test_stats_count_transfers_and_registrations() -> None:
    with kvferry.Engine() as e:
        s0 = e.stats()
        assert s0.registrations == 0 and s0.bytes_written == 0 and s0.tasks_in_flight == 0
        a = e.alloc_buffer(256 * KiB)
        b = bytearray(256 * KiB)
        e.register(b)
        with e.local_segment() as seg:
            e.write(seg, a, kvferry.address_of(b), 100 * KiB)
            e.read(seg, a, kvferry.address_of(b), 28 * KiB)
            s1 = e.stats()
            assert s1.registrations == 2 and s1.open_segments == 1
            assert s1.bytes_written == 100 * KiB and s1.bytes_read == 28 * KiB
            assert s1.tasks_completed == 2 and s1.tasks_failed == 0
        e.unregister(b)
        assert e.stats().registrations == 1


# --------------------------------------------------------------------------
# Memory registration: every kind of object, and what is refused
# --------------------------------------------------------------------------

class FakeTensor:
    """Looks like a torch.Tensor to kvferry (data_ptr(), device, nbytes)."""

    __module__ = "torch"

    def __init__(self, buf: Any, device: Any) -> None:
        self._buf = buf
        self.device = device
        self.nbytes = ctypes.sizeof(buf)

    def data_ptr(self) -> int:
        return ctypes.addressof(self._buf)

    def is_contiguous(self) -> bool:
        return True


def test_register_every_kind_of_memory() -> None:
    with kvferry.Engine() as e, e.local_segment() as seg:
        src = e.alloc_buffer(64 * KiB)
        src.write(pattern(9, 64 * KiB))
        want = pattern(9, 4 * KiB)

        # bytearray: kept exported while registered, so it cannot move.
        ba = bytearray(8 * KiB)
        addr = e.register(ba)
        assert addr == kvferry.address_of(ba)
        with pytest.raises(BufferError):
            ba.extend(b"x")
        e.write(seg, src, addr, 4 * KiB)
        assert bytes(ba[:4 * KiB]) == want
        e.unregister(ba)
        ba.extend(b"x")  # released: resizable again
        with pytest.raises(kvferry.NotRegisteredError):
            e.unregister(addr)

        # mmap (anonymous), ctypes array, int address + length, length shortening.
        mm = mmap.mmap(-1, 16 * KiB)
        m_addr = e.register(mm, 8 * KiB)
        e.write(seg, src, m_addr, 4 * KiB)
        assert mm[:4 * KiB] == want
        with pytest.raises(kvferry.NotRegisteredError):  # only the first 8 KiB are registered
            e.write(seg, src, m_addr + 8 * KiB, 4 * KiB)
        with pytest.raises(BufferError):
            mm.close()
        e.unregister(m_addr)
        mm.close()
        arr = (ctypes.c_uint8 * (8 * KiB))()
        e.register(arr)
        raw = (ctypes.c_char * (8 * KiB))()
        e.register(ctypes.addressof(raw), 8 * KiB)
        e.write_many(seg, [src.addr, src.addr], [ctypes.addressof(arr), ctypes.addressof(raw)], 4 * KiB)
        assert bytes(arr)[:4 * KiB] == want and raw.raw[:4 * KiB] == want
        e.unregister_many([arr, ctypes.addressof(raw)])
        assert e.stats().registrations == 1  # the Buffer
        # One local range (a Buffer) for every request of a column call.
        dup = bytearray(8 * KiB)
        d_addr = e.register(dup)
        e.write_many(seg, src, [d_addr, d_addr + 4 * KiB], 4 * KiB)
        assert bytes(dup) == want * 2
        e.unregister(dup)

        # register_many: all or none.
        x, y = bytearray(4 * KiB), bytearray(4 * KiB)
        addrs = e.register_many([x, (y, 2 * KiB)])
        assert addrs == [kvferry.address_of(x), kvferry.address_of(y)]
        with pytest.raises(kvferry.OverlapError):
            e.register_many([bytearray(4 * KiB), x])
        assert e.stats().registrations == 3
        e.unregister_many(addrs)

        # A tensor look-alike: location from its device.
        tbuf = (ctypes.c_char * (8 * KiB))()
        t_addr = e.register(FakeTensor(tbuf, types.SimpleNamespace(type="cpu", index=None)))
        e.write(seg, src, t_addr, 4 * KiB)
        assert tbuf.raw[:4 * KiB] == want
        e.unregister(t_addr)
        gpu = FakeTensor((ctypes.c_char * 4096)(), types.SimpleNamespace(type="cuda", index=1))
        with pytest.raises(kvferry.UnsupportedError) as ei:
            e.register(gpu)
        assert ei.value.code == _lib.ERR_UNSUPPORTED and "cuda" in ei.value.message


def test_register_numpy_array() -> None:
    np = pytest.importorskip("numpy", reason="numpy is not installed")
    with kvferry.Engine() as e, e.local_segment() as seg:
        a = np.zeros((64, 64), dtype=np.float32)  # 16 KiB
        addr = e.register(a)
        assert addr == a.__array_interface__["data"][0]
        src = e.alloc_buffer(a.nbytes)
        src.write(np.arange(64 * 64, dtype=np.float32).tobytes())
        e.write(seg, src, addr, a.nbytes)
        assert (a.ravel() == np.arange(64 * 64, dtype=np.float32)).all()
        # An int-like address (numpy.uint64) works as an address.
        e.unregister(np.uint64(addr))
        ro = np.zeros(4096, dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            e.register(ro)
        with pytest.raises(ValueError, match="contiguous"):
            e.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])


def test_numpy_and_torch_are_not_imported() -> None:
    code = (
        "import sys, kvferry\n"
        "with kvferry.Engine() as e:\n"
        "    b = bytearray(65536); e.register(b)\n"
        "    with e.local_segment() as s: e.write(s, e.alloc_buffer(4096), kvferry.address_of(b), 4096)\n"
        "    e.unregister(b)\n"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_read_only_and_non_contiguous_objects_are_refused() -> None:
    with kvferry.Engine() as e:
        for obj in (b"immutable bytes" * 300, memoryview(bytearray(4096)).toreadonly(),
                    mmap.mmap(-1, 4096, prot=mmap.PROT_READ)):
            with pytest.raises(ValueError, match="read-only"):
                e.register(obj)
        with pytest.raises(ValueError, match="contiguous"):
            e.register(memoryview(bytearray(8192))[::2])
        with pytest.raises(ValueError):
            e.register(bytearray())  # empty
        with pytest.raises(ValueError, match="exceeds"):
            e.register(bytearray(4096), 8192)
        assert e.stats().registrations == 0


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------

def test_bad_inputs_give_clear_errors() -> None:
    with kvferry.Engine() as e, e.local_segment() as seg:
        reg = bytearray(64 * KiB)
        base = e.register(reg)
        unreg = (ctypes.c_char * (64 * KiB))()
        ua = ctypes.addressof(unreg)

        # Unregistered local memory; unregistered target range.
        with pytest.raises(kvferry.NotRegisteredError) as ei:
            e.write(seg, ua, base, 4096)
        assert ei.value.code == _lib.ERR_NOT_REGISTERED and "request 0" in ei.value.message
        assert not hasattr(ei.value, "statuses")  # rejected before start
        with pytest.raises(kvferry.NotRegisteredError):
            e.write(seg, base, ua, 4096)
        # The error names the failing request of a batch; none of it starts.
        reg[:] = bytes(len(reg))
        src = e.alloc_buffer(8192)
        src.write(b"\x01" * 8192)
        with pytest.raises(kvferry.NotRegisteredError, match="request 2"):
            e.transfer_sync([(Op.WRITE, src, seg, base, 4096), (Op.WRITE, src, seg, base + 4096, 4096),
                             (Op.WRITE, ua, seg, base, 4096)])
        assert bytes(reg[:8192]) == bytes(8192), "a rejected batch moved data"

        # Library-checked arguments: zero length, first page, overlap, bad free.
        with pytest.raises(kvferry.InvalidArgumentError) as ei:
            e.write(seg, src, base, 0)
        assert isinstance(ei.value, ValueError) and ei.value.code == _lib.ERR_INVALID
        with pytest.raises(kvferry.InvalidArgumentError):
            e.register(16, 4096)
        with pytest.raises(kvferry.OverlapError):
            e.register(base + 4096, 4096)
        with pytest.raises(kvferry.InvalidArgumentError):
            e.free_buffer(base)
        with pytest.raises(kvferry.NotRegisteredError):
            e.unregister(ua)
        with pytest.raises(kvferry.InvalidArgumentError):
            e.abort(0)
        with pytest.raises(kvferry.InvalidArgumentError):
            e.abort(1, ["not a segment name"], timeout=1)
        with pytest.raises(kvferry.InvalidArgumentError):
            seg.buffer(99)

        # Wrong types and values, refused in Python.
        for bad in ("text", 1.5, None, object(), True):
            with pytest.raises(TypeError):
                e.register(bad)
        with pytest.raises(TypeError):
            e.register(base)  # an int address without length
        with pytest.raises(ValueError):
            e.register(base, -1)
        with pytest.raises(TypeError):
            e.write(seg, src, base, 4096.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            e.write(seg, src, -base, 4096)
        with pytest.raises(ValueError):
            e.write(seg, src, base, 1 << 64)
        with pytest.raises(TypeError):
            e.write("host:1", src, base, 4096)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            e.transfer_sync([(7, src, seg, base, 4096)])
        with pytest.raises(TypeError):
            e.transfer_sync([("write", src, seg, base, 4096)])
        with pytest.raises(TypeError):
            e.transfer_sync([(Op.WRITE, src, seg)])
        with pytest.raises(TypeError):
            e.transfer_sync([object()])  # type: ignore[list-item]
        # The error names the request and field at fault.
        with pytest.raises(ValueError, match="request 1: length"):
            e.transfer_sync([(Op.WRITE, src, seg, base, 4096), (Op.WRITE, src, seg, base, -1)])
        with pytest.raises(TypeError, match="request 2: remote"):
            e.transfer_sync([Request(Op.WRITE, src, seg, base, 16)] * 2 + [Request(Op.WRITE, src, seg, "x", 16)])
        with pytest.raises(TypeError, match="request 1"):
            e.transfer_sync([(Op.WRITE, src, seg, base, 16), (True, src, seg, base, 16)])
        with pytest.raises(ValueError):
            e.write_many(seg, [src.addr, src.addr], [base], 4096)  # columns of different lengths
        with pytest.raises(TypeError):
            e.write_many(seg, [src.addr], [base], [4096.0])
        with pytest.raises(TypeError):
            e.write(seg, src, base, 4096, timeout="1")  # type: ignore[arg-type]
        for bad_t in (-1, 0, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                e.write(seg, src, base, 4096, timeout=bad_t)
        with pytest.raises(TypeError):
            e.open_segment(b"127.0.0.1:1")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            kvferry.Engine(host=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            kvferry.Engine(port=70000)
        with pytest.raises(ValueError):
            kvferry.Engine(paths_per_peer=1 << 40)
        with pytest.raises(kvferry.InvalidArgumentError):
            kvferry.Engine(slice_size=100)  # below 4 KiB: the library says so
        with pytest.raises(kvferry.UnsupportedError, match="rdma"):
            kvferry.Engine(protocol="rdma")  # this build has tcp only: an error, not a fallback
        with pytest.raises(kvferry.KvferryError, match="already in use"):
            kvferry.Engine(port=e.port)
        with pytest.raises(ValueError):
            e.batch(0)
        assert e.transfer_sync([]) == []

        # A batch's capacity; a segment of another engine.
        with e.batch(2) as b:
            with pytest.raises(kvferry.BatchFullError):
                b.submit([(Op.WRITE, src, seg, base, 16)] * 3)
            assert len(b) == 0
            with pytest.raises(kvferry.InvalidArgumentError):
                b.status(0)
        with kvferry.Engine() as other, other.local_segment() as oseg:
            with pytest.raises(ValueError, match="another engine"):
                e.write(oseg, src, base, 4096)

        # Buffer bounds.
        with pytest.raises(ValueError):
            src.write(b"x", 8192)
        with pytest.raises(ValueError):
            src.read(1, 8192)
        assert src.read(4, 0) == b"\x01" * 4


def test_unknown_peer_is_unreachable_by_the_deadline() -> None:
    with kvferry.Engine() as e:
        t0 = time.monotonic()
        with pytest.raises(kvferry.UnreachableError) as ei:
            e.open_segment("127.0.0.1:1", timeout=0.3)
        took = time.monotonic() - t0
        assert isinstance(ei.value, ConnectionError) and ei.value.code == _lib.ERR_UNREACHABLE
        assert took < 3.0, f"open_segment of an unknown peer took {took:.2f} s for a 0.3 s timeout"
        assert "127.0.0.1:1" in ei.value.message


def test_closed_engine_raises_and_never_crashes() -> None:
    e = kvferry.Engine()
    name = e.name
    seg = e.local_segment()
    b = e.batch(4)
    buf = e.alloc_buffer(4096)
    kept = bytearray(4096)
    e.register(kept)
    raw_engine, raw_seg = e.handle, seg.handle
    e.close()
    e.close()  # idempotent
    assert e.closed and seg.closed and b.freed and buf.freed
    assert repr(e) == f"<kvferry.Engine {name} closed>"
    kept.extend(b"x")  # released by close: resizable again
    calls = [
        lambda: e.register(bytearray(4096)), lambda: e.alloc_buffer(4096), lambda: e.open_segment(name),
        lambda: e.stats(), lambda: e.poll_events(0), lambda: e.event_fd(), lambda: e.abort(1),
        lambda: e.grant("127.0.0.1:1", 1, [(buf.addr, 16)]), lambda: e.revoke(1), lambda: e.batch(1),
        lambda: e.write(seg, buf, buf.addr, 16), lambda: seg.buffers(), lambda: seg.notify(1),
        lambda: b.submit([(Op.WRITE, buf, seg, buf.addr, 16)]), lambda: b.wait(0), lambda: b.statuses(),
        lambda: b.cancel(), lambda: buf.read(), lambda: buf.write(b"x"), lambda: buf.view(),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(kvferry.EngineClosedError) as ei:
            call()
        assert ei.value.code == _lib.ERR_CLOSED, i
        assert "closed" in str(ei.value) or "freed" in str(ei.value)
    seg.close()  # no-ops after the engine's close
    b.free()
    # The library itself validates stale handles: ERR_HANDLE, not a crash.
    lib = _lib.lib()
    assert lib.kvf_engine_stats(raw_engine, ctypes.byref(_lib.Stats(struct_size=ctypes.sizeof(_lib.Stats)))) \
        == _lib.ERR_HANDLE
    assert lib.kvf_close_segment(raw_seg) == _lib.ERR_HANDLE
    assert lib.kvf_engine_destroy(raw_engine) == _lib.ERR_HANDLE


def test_entering_a_closed_engine_raises() -> None:
    e = kvferry.Engine()
    e.close()
    with pytest.raises(kvferry.EngineClosedError):
        with e:
            pass


def test_unclosed_objects_are_finalized() -> None:
    """An engine (with segments and batches) dropped without close is
    destroyed by the garbage collector: no handle stays alive."""
    e = kvferry.Engine()
    h = e.handle
    seg = e.local_segment()
    sh = seg.handle
    b = e.batch(1)
    del e, seg, b
    gc.collect()
    lib = _lib.lib()
    assert lib.kvf_close_segment(sh) == _lib.ERR_HANDLE
    assert lib.kvf_engine_destroy(h) == _lib.ERR_HANDLE


# --------------------------------------------------------------------------
# Batches, errors, the GIL
# --------------------------------------------------------------------------

def test_batch_failures_and_context_manager() -> None:
    with kvferry.Engine() as e, e.local_segment() as seg:
        a = e.alloc_buffer(64 * KiB)
        b_mem = e.alloc_buffer(64 * KiB)
        a.write(pattern(3, 64 * KiB))
        with e.batch(8) as b:
            r1 = b.submit([Request(Op.WRITE, a.addr, seg, b_mem.addr, 16 * KiB, 1)])
            r2 = b.submit_many(Op.WRITE, seg, [a.addr + 16 * KiB, a.addr + 32 * KiB],
                               [b_mem.addr + 16 * KiB, b_mem.addr + 32 * KiB], 16 * KiB, request_id=[2, 3])
            assert list(r1) == [0] and list(r2) == [1, 2]
            assert b.wait(5)
            assert b_mem.read(48 * KiB) == pattern(3, 64 * KiB)[:48 * KiB]
        assert b.freed
        b.free()
        # A task whose request id the owner (this engine) aborted ends ABORTED.
        assert e.abort(9, timeout=1).safe
        with e.batch(2) as b:
            b.submit([(Op.WRITE, a, seg, b_mem.addr, 4096, 9), (Op.WRITE, a, seg, b_mem.addr, 4096, 10)])
            with pytest.raises(kvferry.AbortedError) as ei:
                b.wait(5)
            sts = ei.value.statuses
            assert [s.state for s in sts] == [TaskState.ABORTED, TaskState.COMPLETED]
            assert not sts[0].ok and sts[0].final and sts[1].ok
            assert b.task_error(0) != "" and b.task_error(1) == ""
        sts = e.transfer_sync([(Op.WRITE, a, seg, b_mem.addr, 4096, 9)], check=False)
        assert sts[0].state == TaskState.ABORTED and sts[0].error == _lib.ERR_ABORTED
        # Requests over two segment handles, from a generator, in one call.
        with e.local_segment() as seg2:
            a.write(pattern(4, 64 * KiB))
            sts = e.transfer_sync(Request(Op.WRITE, a.addr + i * 4096, (seg, seg2)[i % 2], b_mem.addr + i * 4096,
                                          4096, 11) for i in range(16))
            assert sts == [TaskStatus(TaskState.COMPLETED, 0, 4096)] * 16
            assert b_mem.read() == pattern(4, 64 * KiB)


def test_errors_are_typed_and_picklable() -> None:
    err = kvferry.error_for(_lib.ERR_TIMEOUT, "kvf_x: deadline")
    assert isinstance(err, kvferry.TimedOutError) and isinstance(err, TimeoutError)
    assert isinstance(err, kvferry.KvferryError) and err.code == 8 and err.message == "kvf_x: deadline"
    err.statuses = [TaskStatus(TaskState.TIMEOUT, 8, 0)]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kvferry.TimedOutError and back.code == 8 and back.message == err.message
    assert back.statuses == err.statuses
    assert isinstance(kvferry.error_for(_lib.ERR_INVALID, "m"), ValueError)
    assert isinstance(kvferry.error_for(_lib.ERR_UNREACHABLE, "m"), ConnectionError)
    assert type(kvferry.error_for(999, "m")) is kvferry.UnknownStatusError
    fenced = kvferry.error_for(_lib.ERR_FENCED, "m")
    assert type(fenced) is kvferry.FencedError and isinstance(fenced, kvferry.RefusedError)
    assert type(kvferry.error_for(_lib.ERR_UNAUTHENTICATED, "m")) is kvferry.UnauthenticatedError
    for code in range(1, _lib.ERR_UNAUTHENTICATED + 1):
        e = kvferry.error_for(code, "msg")
        assert e.code == code and type(e) is not kvferry.UnknownStatusError
        assert pickle.loads(pickle.dumps(e)).code == code


def test_blocking_calls_release_the_gil() -> None:
    """A thread blocked in poll_events does not stop Python in another."""
    with kvferry.Engine() as e:
        t = threading.Thread(target=e.poll_events, args=(0.6,))
        t0 = time.monotonic()
        t.start()
        n = 0
        while time.monotonic() - t0 < 0.2:
            n += 1
        still_blocked = t.is_alive()
        t.join()
        assert still_blocked, "poll_events returned early"
        assert n > 1000, f"the main thread ran only {n} iterations while another was blocked in the library"


def test_rdma_without_libibverbs_is_a_clean_error() -> None:
    # The environment is read when the library loads: a child process with
    # KVFERRY_IBVERBS_LIBRARY pointing nowhere asks for rdma.
    code = (
        "import kvferry\n"
        "try:\n"
        "    kvferry.Engine(protocol='rdma')\n"
        "except kvferry.UnsupportedError as err:\n"
        "    print('unsupported:', err)\n"
        "with kvferry.Engine() as e:\n"  # auto: tcp without rdma
        "    print('auto ok', e.name)\n")
    env = dict(os.environ, KVFERRY_IBVERBS_LIBRARY="/nonexistent/libibverbs.so.1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "unsupported:" in out.stdout and "rdma not available" in out.stdout, out.stdout
    assert "auto ok" in out.stdout, out.stdout
