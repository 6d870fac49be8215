"""Tests of kvferry.mooncake.TransferEngine, the drop-in Mooncake shim.

Peers run in processes started with the "spawn" method (a process that loaded
libkvferry.so must not fork without exec); the pytest process is the other
side. Every data check is byte for byte. Mooncake itself is not needed,
except by test_script_against_real_mooncake, which skips without it.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Tuple

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import mooncake_shim_script as script  # noqa: E402
from _helpers import pattern, wait_until  # noqa: E402
from kvferry import _lib  # noqa: E402
from kvferry.mooncake import TransferEngine, TransferOpcode, _mc_timeout_seconds  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
HOST = "127.0.0.1"


def buf(size: int, fill: bytes = b"") -> Tuple[ctypes.Array, int]:
    """A buffer of this process and its address, optionally filled."""
    b = (ctypes.c_char * size)()
    if fill:
        ctypes.memmove(b, (fill * (size // len(fill) + 1))[:size], size)
    return b, ctypes.addressof(b)


@pytest.fixture(scope="module")
def peer() -> Iterator[script.Peer]:
    p = script.Peer("kvferry")
    yield p
    p.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    e = TransferEngine()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    yield e
    e.close()


@pytest.fixture(scope="module")
def remote(peer: script.Peer) -> int:
    """A 4 MiB registered buffer in the peer."""
    return peer("alloc", 4 * MiB)


def write_fresh_mib(engine: TransferEngine, peer: script.Peer, local: int, slots: int, seed: int,
                    **kw: int) -> None:
    """WRITEs a fresh MiB (pattern of seed) from local + 5 MiB to the peer's
    slots, checks that it landed, then clears the source."""
    fresh = pattern(seed, MiB)
    ctypes.memmove(local + 5 * MiB, fresh, MiB)
    assert engine.transfer_sync_write(peer.session, local + 5 * MiB, slots, MiB, **kw) == 0, engine.last_error()
    assert peer("get", slots, MiB) == fresh
    ctypes.memset(local + 5 * MiB, 0x5A, MiB)


# ---------------------------------------------------------------- data paths


def test_sync_write_and_read_both_ways(engine: TransferEngine, peer: script.Peer, remote: int) -> None:
    """transfer_sync_write/read from us into the peer and back, and the peer
    initiating into our memory: each checked byte for byte."""
    b, local = buf(MiB)
    assert engine.register_memory(local, MiB) == 0
    try:
        data = pattern(1, 300_000)
        ctypes.memmove(local, data, len(data))
        assert engine.transfer_sync_write(peer.session, local, remote + 4096, len(data)) == 0
        assert peer("get", remote + 4096, len(data)) == data
        assert peer("get", remote, 4096) == bytes(4096)  # nothing before the target range

        back = pattern(2, 200_000)
        peer("put", remote + 2 * MiB, back)
        assert engine.transfer_sync_read(peer.session, local + 512 * 1024, remote + 2 * MiB, len(back)) == 0
        assert ctypes.string_at(local + 512 * 1024, len(back)) == back

        # The peer initiates: it writes into and reads from our memory.
        theirs = pattern(3, 100_000)
        peer("put", remote + 3 * MiB, theirs)
        assert peer.call("transfer_sync_write", engine.get_session_id(), remote + 3 * MiB, local, len(theirs)) == 0
        assert ctypes.string_at(local, len(theirs)) == theirs
        ours = pattern(4, 50_000)
        ctypes.memmove(local + 800_000, ours, len(ours))
        assert peer.call("transfer_sync_read", engine.get_session_id(), remote + 3 * MiB, local + 800_000,
                         len(ours)) == 0
        assert peer("get", remote + 3 * MiB, len(ours)) == ours
    finally:
        assert engine.unregister_memory(local) == 0


def test_batch_sync_both_ways(engine: TransferEngine, peer: script.Peer, remote: int) -> None:
    """batch_transfer_sync_write/read with scattered entries, and the generic
    batch_transfer_sync with a TransferOpcode."""
    b, local = buf(MiB)
    assert engine.register_memory(local, MiB) == 0
    try:
        data = pattern(5, MiB)
        ctypes.memmove(local, data, MiB)
        n, size = 64, 4096
        order = random.Random(6).sample(range(n), n)  # scattered destinations
        srcs = [local + i * size for i in range(n)]
        dsts = [remote + order[i] * size for i in range(n)]
        assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [size] * n) == 0
        got = peer("get", remote, n * size)
        for i in range(n):
            assert got[order[i] * size:(order[i] + 1) * size] == data[i * size:(i + 1) * size]

        ctypes.memset(local, 0, MiB)
        assert engine.batch_transfer_sync_read(peer.session, srcs, dsts, [size] * n) == 0
        assert ctypes.string_at(local, n * size) == data[:n * size]

        ctypes.memset(local, 0, MiB)
        assert engine.batch_transfer_sync(peer.session, srcs[:8], dsts[:8], [size] * 8, TransferOpcode.Read) == 0
        assert ctypes.string_at(local, 8 * size) == data[:8 * size]
        # Zero-length entries complete without moving anything, as in Mooncake.
        assert engine.batch_transfer_sync_write(peer.session, [local, local], [remote, remote], [0, 0]) == 0
        assert engine.batch_transfer_sync_write(peer.session, [], [], []) == 0
    finally:
        assert engine.unregister_memory(local) == 0


def test_async_batches_and_submit(engine: TransferEngine, peer: script.Peer, remote: int) -> None:
    """batch_transfer_async_write/read with get_batch_transfer_status, and
    transfer_submit_write with transfer_check_status."""
    b, local = buf(2 * MiB)
    assert engine.register_memory(local, 2 * MiB) == 0
    try:
        data = pattern(7, MiB)
        ctypes.memmove(local, data, MiB)
        w = engine.batch_transfer_async_write(peer.session, [local, local + MiB // 2], [remote, remote + MiB // 2],
                                              [MiB // 2, MiB // 2])
        assert w != 0
        assert engine.get_batch_transfer_status([w]) == 0
        assert peer("get", remote, MiB) == data

        theirs = pattern(8, MiB)
        peer("put", remote + 2 * MiB, theirs)
        r1 = engine.batch_transfer_async_read(peer.session, [local + MiB], [remote + 2 * MiB], [MiB // 2])
        r2 = engine.batch_transfer_async_read(peer.session, [local + MiB + MiB // 2], [remote + 2 * MiB + MiB // 2],
                                              [MiB // 2])
        assert 0 not in (r1, r2) and r1 != r2
        assert engine.get_batch_transfer_status([r1, r2]) == 0
        assert ctypes.string_at(local + MiB, MiB) == theirs
        # Completed batches were freed, as Mooncake frees them.
        assert engine.get_batch_transfer_status([r1]) == -1

        one = pattern(9, 10_000)
        ctypes.memmove(local, one, len(one))
        t = engine.transfer_submit_write(peer.session, local, remote + 3 * MiB, len(one))
        assert t != 0
        deadline = time.monotonic() + 10
        while (st := engine.transfer_check_status(t)) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert st == 1
        assert peer("get", remote + 3 * MiB, len(one)) == one
        assert engine.transfer_check_status(t) == -1  # freed on completion
    finally:
        assert engine.unregister_memory(local) == 0


def test_memory_and_managed_buffers(engine: TransferEngine, peer: script.Peer) -> None:
    """batch_register/unregister (all or none), managed buffers used as
    transfer targets, write/read_bytes, get_first_buffer_address."""
    bufs = [buf(64 * 1024) for _ in range(4)]
    addrs = [a for _, a in bufs]
    assert engine.batch_register_memory(addrs, [64 * 1024] * 4) == 0
    assert engine.batch_register_memory(addrs[:1], [64 * 1024]) == -7  # overlap
    assert engine.batch_unregister_memory(addrs) == 0
    assert engine.batch_unregister_memory(addrs) == -3
    assert engine.register_memory(addrs[0], 64 * 1024) == 0
    assert engine.unregister_memory(addrs[0]) == 0

    m = engine.allocate_managed_buffer(MiB)
    assert m != 0
    assert engine.write_bytes_to_buffer(m, b"kvferry", 7) == 0
    assert engine.read_bytes_from_buffer(m, 7) == b"kvferry"
    # A peer writes into the managed buffer (it is registered).
    src = peer("alloc", 4096)
    peer("put", src, b"from the peer")
    assert peer.call("transfer_sync_write", engine.get_session_id(), src, m + 100, 13) == 0
    assert engine.read_bytes_from_buffer(m + 100, 13) == b"from the peer"
    assert engine.free_managed_buffer(m, MiB) == 0
    assert engine.free_managed_buffer(m, MiB) == -1  # not (any more) a managed buffer
    assert engine.allocate_managed_buffer(0) == 0

    # The lowest address the peer registered, from a descriptor fetched now
    # (an open session keeps the descriptor it fetched first).
    with TransferEngine() as fresh:
        assert fresh.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        assert fresh.get_first_buffer_address(peer.session) == min(peer("addrs"))


def test_send_probe(engine: TransferEngine, peer: script.Peer) -> None:
    """send_probe: 0 for a live peer; Mooncake's socket error for a closed
    port, fast."""
    assert engine.send_probe(peer.session) == 0
    t = time.monotonic()
    assert engine.send_probe(f"{HOST}:{closed_port()}") == -102
    assert time.monotonic() - t < 2
    assert engine.send_probe("no-port") == -1


# ------------------------------------------------------------- SGLang script


def test_sglang_scenario_script() -> None:
    """The SGLang-like script (P2PHANDSHAKE, session "host:port", many-buffer
    batch_transfer_sync_write of KV pages, verify) passes on kvferry."""
    r = subprocess.run([sys.executable, str(HERE / "mooncake_shim_script.py"), "--impl", "kvferry"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), r.stdout + r.stderr


def mooncake_python() -> str:
    """An interpreter with Mooncake: this one, or $KVFERRY_TEST_MOONCAKE_PYTHON."""
    if importlib.util.find_spec("mooncake") is not None:
        return sys.executable
    return os.environ.get("KVFERRY_TEST_MOONCAKE_PYTHON", "")


@pytest.mark.skipif(not mooncake_python(), reason="mooncake is not importable (pip install "
                    "mooncake-transfer-engine-non-cuda, or set KVFERRY_TEST_MOONCAKE_PYTHON to a Python that has it)")
def test_script_against_real_mooncake() -> None:
    """The same script, unchanged, passes against the real Mooncake."""
    r = subprocess.run([mooncake_python(), str(HERE / "mooncake_shim_script.py"), "--impl", "mooncake"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), r.stdout + r.stderr[-4000:]


# ------------------------------------------------------- the PD flow, fenced


def _fence_flow(python: str, impl: str, *extra: str, **env: str) -> dict:
    import json

    r = subprocess.run([python, str(HERE / "mooncake_shim_script.py"), "--impl", impl, "--fence-flow", *extra],
                       capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sglang_flow_decode_fences_a_room_it_gives_up() -> None:
    """SGLang's PD flow in two spawned processes, as its wrapper drives the
    engine: "rdma" on a host without RDMA and "localhost"; prefill sends
    four rooms at once from a thread pool, each one batch_transfer_sync_write
    of scattered pages with no request id. Decode gives the large room up
    while it is landing: fence_memory of its pages returns 0, decode reuses
    them at once, and no byte of the given-up room lands afterwards; the
    bystander rooms complete intact, and the next room, written into the
    same pages after the fence, completes. Without the fence the same flow
    leaves the old room's bytes in the reused pages, so the test can fail."""
    env = {"KVFERRY_SCRIPT_PROTOCOL": "rdma", "KVFERRY_SCRIPT_HOST": "localhost"}
    fenced = _fence_flow(sys.executable, "kvferry", **env)
    for a in fenced["attempts"]:
        assert a["fence"] == 0 and a["corrupt_bytes"] == 0, a
        assert a["bystanders"] == [0, 0, 0] and a["bystanders_ok"], a
        assert a["next"] == 0 and a["next_ok"], a
    assert fenced["attempts"][-1]["room_a"] == -1, f"the fence never struck while the room was landing: {fenced}"
    unfenced = _fence_flow(sys.executable, "kvferry", "--no-fence", **env)
    assert any(a["corrupt_bytes"] > 0 for a in unfenced["attempts"]), \
        f"without the fence no old byte landed in the reused pages: the fenced run proves nothing ({unfenced})"
    print(f"fenced: {fenced}\nunfenced: {unfenced}")


@pytest.mark.skipif(not mooncake_python(), reason="mooncake is not importable (pip install "
                    "mooncake-transfer-engine-non-cuda, or set KVFERRY_TEST_MOONCAKE_PYTHON to a Python that has it)")
def test_sglang_flow_on_real_mooncake_for_comparison() -> None:
    """The same flow on PyPI's Mooncake, which has no fence: recorded side
    by side (decode's reused pages and the next room), asserting only that
    the flow ran."""
    # 64 MiB: PyPI's Mooncake fails a 256 MiB room's batch outright at times.
    res = _fence_flow(mooncake_python(), "mooncake", "--room-mib", "64")
    assert res["attempts"], res
    print(f"mooncake: {res}")


# --------------------------------------------------------------------- abort


def test_pd_abort_mid_transfer_then_reuse(engine: TransferEngine, peer: script.Peer) -> None:
    """The PD abort scenario through the shim: decode (the peer, owner of the
    slots) aborts a request while prefill (us) writes 64 MiB into them, and
    refills the slots as soon as the abort returned safe. No byte of the
    aborted request lands afterwards, prefill's transfer ends with
    ERR_ABORTED, the request id stays refused, and a new one works."""
    size = 64 * MiB
    slots = peer("alloc", size)
    b, local = buf(size, b"\x5a")
    assert engine.register_memory(local, size) == 0
    me = engine.get_session_id()
    caught = 0
    try:
        for attempt in range(3):
            rid = 1000 + attempt
            peer("fill", slots, size, 0)
            n = 64
            bid = engine.batch_transfer_async_write(peer.session, [local + i * MiB for i in range(n)],
                                                    [slots + i * MiB for i in range(n)], [MiB] * n, request_id=rid)
            assert bid != 0
            ret, took = peer("abort_then_fill", rid, [me], 5.0, slots, size, 0xAB)
            assert ret == 0, f"abort not safe after {took:.3f} s"
            status = engine.get_batch_transfer_status([bid])
            if status == -1:
                assert engine.last_error()[0] == _lib.ERR_ABORTED, engine.last_error()
                caught += 1
            # Whatever the timing, nothing of the aborted request is in the
            # reused slots once the abort returned safe.
            assert peer("count_not", slots, size, 0xAB) == 0
            # The aborted id stays refused; a fresh id moves data again.
            assert engine.transfer_sync_write(peer.session, local, slots, 4096, request_id=rid) == -1
            assert engine.last_error()[0] == _lib.ERR_ABORTED
            assert peer("count_not", slots, size, 0xAB) == 0
            write_fresh_mib(engine, peer, local, slots, rid, request_id=rid + 100)
            if caught:
                break
        assert caught >= 1, "no abort landed while the transfer was in flight in 3 attempts"
    finally:
        assert engine.unregister_memory(local) == 0


# --------------------------------------------------------------------- fence


def test_fence_memory_then_the_next_write_lands(engine: TransferEngine, peer: script.Peer) -> None:
    """Decode (the peer) owns pages that prefill (us) wrote with no request
    id, with transfer_sync_write and batch_transfer_sync_write as SGLang's
    wrapper does. Decode fences the room's page ranges before freeing them
    (fence_memory returns 0); prefill's next writes into the same pages,
    planned after the fence, succeed and land."""
    size, page, n = 2 * MiB, 64 * KiB, 16
    pages = peer("alloc", size)
    b, local = buf(size)
    assert engine.register_memory(local, size) == 0
    srcs = [local + MiB + i * page for i in range(n)]
    dsts = [pages + MiB + i * page for i in range(n)]
    try:
        before = peer("stats")
        first = pattern(11, size)
        ctypes.memmove(local, first, size)
        assert engine.transfer_sync_write(peer.session, local, pages, MiB) == 0
        assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [page] * n) == 0
        assert peer("get", pages, size) == first
        # Decode frees the room: every page run it handed out, fenced first.
        assert peer.call("fence_memory", [pages] + dsts, [MiB] + [page] * n, 5.0) == 0
        st = peer("stats")
        assert st["fences_safe"] == before["fences_safe"] + 1 and st["fence_epoch"] == before["fence_epoch"] + 1
        # We acknowledge the notice once we applied it: from then on our
        # transfers are planned under the new epoch.
        wait_until(lambda: peer("stats")["fence_acks"] > before["fence_acks"], 10, "prefill acknowledged the fence")
        second = pattern(12, size)
        ctypes.memmove(local, second, size)
        assert engine.transfer_sync_write(peer.session, local, pages, MiB) == 0, engine.last_error()
        assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [page] * n) == 0, engine.last_error()
        assert peer("get", pages, size) == second
        assert peer("stats")["fence_refused"] == before["fence_refused"]
    finally:
        assert engine.unregister_memory(local) == 0


def test_pd_fence_mid_transfer_then_reuse(engine: TransferEngine, peer: script.Peer) -> None:
    """The PD scenario without request ids: prefill (us) writes 64 MiB into
    decode's (the peer's) slots with batch_transfer_async_write and no
    request id; decode fences the slots while that is under way and refills
    them as soon as fence_memory returned 0. No byte of the old transfer
    lands afterwards, prefill's batch ends -1 with ERR_FENCED (an abort
    could not have stopped it: it carries no request id), and prefill's
    next write into the slots lands."""
    size = 64 * MiB
    slots = peer("alloc", size)
    b, local = buf(size, b"\x5a")
    assert engine.register_memory(local, size) == 0
    caught = 0
    try:
        for attempt in range(3):
            peer("fill", slots, size, 0)
            acks = peer("stats")["fence_acks"]
            n = 64
            bid = engine.batch_transfer_async_write(peer.session, [local + i * MiB for i in range(n)],
                                                    [slots + i * MiB for i in range(n)], [MiB] * n)
            assert bid != 0
            ret, took = peer("fence_then_fill", [slots], [size], 5.0, slots, size, 0xAB)
            assert ret == 0, f"fence not safe after {took:.3f} s"
            status = engine.get_batch_transfer_status([bid])
            if status == -1:
                assert engine.last_error()[0] == _lib.ERR_FENCED, engine.last_error()
                caught += 1
            else:
                assert status == 0, engine.last_error()
            # Whatever the timing, nothing of the old transfer is in the
            # reused slots once the fence returned safe.
            assert peer("count_not", slots, size, 0xAB) == 0
            # The next request's write, planned after the fence, lands.
            wait_until(lambda: peer("stats")["fence_acks"] > acks, 10, "prefill acknowledged the fence")
            write_fresh_mib(engine, peer, local, slots, attempt)
            assert peer("count_not", slots + MiB, size - MiB, 0xAB) == 0
            if caught:
                break
        assert caught >= 1, "no fence struck while the transfer was in flight in 3 attempts"
    finally:
        assert engine.unregister_memory(local) == 0


def test_fence_memory_argument_errors_return_minus_one(engine: TransferEngine,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    size = 64 * KiB
    mem, addr = buf(size)
    other, other_addr = buf(size)  # never registered
    assert engine.register_memory(addr, size) == 0
    try:
        for addrs, lengths, code, text in [
            ([addr, addr + 4096], [4096], _lib.ERR_INVALID, "2 addrs and 1 lengths"),
            ([], [], _lib.ERR_INVALID, "no ranges"),
            ([addr, addr + 4096], [4096, 0], _lib.ERR_INVALID, "range 1 length is 0"),
            ([16], [4096], _lib.ERR_INVALID, "first page"),
            ([addr, other_addr], [4096, 4096], _lib.ERR_NOT_REGISTERED, "range 1"),
            ([addr + size - 4096], [8192], _lib.ERR_NOT_REGISTERED, "not registered"),
        ]:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvferry.mooncake"):
                assert engine.fence_memory(addrs, lengths) == -1, (addrs, lengths)
            got, msg = engine.last_error()
            assert got == code and text in msg, (addrs, lengths, got, msg)
            assert [r.levelno for r in caplog.records] == [logging.ERROR], caplog.records
        for bad in (("x", [1]), ([1.5], [4096]), ([-1], [4096]), ([addr], None)):
            with pytest.raises(TypeError):
                engine.fence_memory(*bad)  # type: ignore[arg-type]
        assert engine.fence_memory([addr], [4096]) == 0
        assert engine.fence_memory([addr, addr + 8192], [4096, 4096], 1.0) == 0
    finally:
        assert engine.unregister_memory(addr) == 0


class _NotSafeLibrary:
    """The library with kvf_fence_memory answering "not safe" as it does at
    a deadline (safe written as 0, KVF_ERR_TIMEOUT, a reason): a real one
    needs a copy stuck past the deadline."""

    reason = b"kvf_fence_memory: fence of 1 ranges: not safe: copies still in progress at the deadline"

    def __init__(self, lib: object) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def kvf_fence_memory(self, engine: object, addrs: object, lengths: object, n: int, ms: int,
                         out: object) -> int:
        res = ctypes.cast(out, ctypes.POINTER(_lib.FenceResult)).contents
        res.safe, res.epoch = 0, 3
        return _lib.ERR_TIMEOUT

    def kvf_last_error(self) -> bytes:
        return self.reason


def test_fence_memory_not_safe_returns_minus_one_with_a_warning(
        engine: TransferEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(engine, "_lib", _NotSafeLibrary(engine._lib))
    with caplog.at_level(logging.WARNING, logger="kvferry.mooncake"):
        assert engine.fence_memory([1 << 20], [4096], 0.5) == -1
    assert engine.last_error() == (_lib.ERR_TIMEOUT, _NotSafeLibrary.reason.decode())
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, _NotSafeLibrary.reason.decode())]


# --------------------------------------------------------------- deadlines


def test_mc_transfer_timeout_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """MC_TRANSFER_TIMEOUT as Mooncake reads it: atoi, at least 5 s, default 30."""
    assert _mc_timeout_seconds(None) == 30
    assert _mc_timeout_seconds("12") == 12
    assert _mc_timeout_seconds("2") == 5
    assert _mc_timeout_seconds(" 9s") == 9
    assert _mc_timeout_seconds("junk") == 5
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "7")
    e = TransferEngine()
    assert e._timeout_s == 7.0  # read in the constructor, like Mooncake
    with pytest.raises(ValueError):
        TransferEngine(transfer_timeout=0)


def test_sync_write_bounded_when_peer_paused() -> None:
    """A sync write to a peer that stopped (SIGSTOP) returns -1 with
    ERR_TIMEOUT by its deadline (transfer timeout + 1 ns per byte), and the
    session works again once the peer resumes."""
    p = script.Peer("kvferry")
    e = TransferEngine(transfer_timeout=0.5)
    try:
        assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        size = 64 * MiB
        remote = p("alloc", size)
        pid = p("pid")
        b, local = buf(size, b"\x11")
        assert e.register_memory(local, size) == 0
        assert e.transfer_sync_write(p.session, local, remote, 4096) == 0  # session open
        os.kill(pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert e.batch_transfer_sync_write(p.session, [local + i * MiB for i in range(64)],
                                               [remote + i * MiB for i in range(64)], [MiB] * 64) == -1
            took = time.monotonic() - t
            assert e.last_error()[0] == _lib.ERR_TIMEOUT, e.last_error()
            assert 0.5 <= took < 2.0, took
        finally:
            os.kill(pid, signal.SIGCONT)
        data = pattern(11, MiB)
        ctypes.memmove(local, data, MiB)
        assert e.transfer_sync_write(p.session, local, remote, MiB) == 0
        assert p("get", remote, MiB) == data
    finally:
        e.close()
        p.close()


# --------------------------------------------------------------- bad inputs


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_bad_transfers_give_mooncake_codes(engine: TransferEngine, peer: script.Peer, remote: int) -> None:
    """Unregistered local or remote memory, unknown peers, malformed session
    ids and mismatched lists return Mooncake's codes, never raise."""
    b, local = buf(8192)
    assert engine.transfer_sync_write(peer.session, local, remote, 16) == -1  # local not registered
    assert engine.last_error()[0] == _lib.ERR_NOT_REGISTERED
    assert engine.register_memory(local, 8192) == 0
    try:
        assert engine.transfer_sync_write(peer.session, local, 4096 * 7, 16) == -1  # remote not registered
        assert engine.last_error()[0] == _lib.ERR_REMOTE_RANGE
        assert engine.batch_transfer_sync_read(peer.session, [local], [remote, remote], [16]) == -1
        assert engine.batch_transfer_async_write(peer.session, [local], [], [16]) == 0
        t = time.monotonic()
        unknown = f"{HOST}:{closed_port()}"
        assert engine.transfer_sync_write(unknown, local, remote, 16) == -1
        assert engine.batch_transfer_async_write(unknown, [local], [remote], [16]) == 0
        assert engine.transfer_submit_write(unknown, local, remote, 16) == 0
        assert engine.get_first_buffer_address(unknown) == 0
        assert time.monotonic() - t < 2, "unknown peers must fail fast, as in Mooncake"
        assert engine.transfer_sync_write("no-port", local, remote, 16) == -1
        assert engine.get_batch_transfer_status([12345]) == -1
        assert engine.transfer_check_status(12345) == -1
        assert engine.register_memory(local, 8192) == -7
        assert engine.register_memory(local + 4096, 16) == -7
        assert engine.register_memory(local, 0) == -1
        assert engine.unregister_memory(local + 1) == -3
        assert engine.write_bytes_to_buffer(local, b"ab", 3) == -1
        # The session still works after all that.
        ctypes.memmove(local, b"still fine", 10)
        assert engine.transfer_sync_write(peer.session, local, remote + 100, 10) == 0
        assert peer("get", remote + 100, 10) == b"still fine"
    finally:
        assert engine.unregister_memory(local) == 0


@pytest.mark.parametrize("call", [
    lambda e, s: e.register_memory("0x1000", 16),
    lambda e, s: e.register_memory(1 << 20, 1.5),
    lambda e, s: e.register_memory(-4096, 16),
    lambda e, s: e.unregister_memory(None),
    lambda e, s: e.batch_register_memory([1 << 20], ["16"]),
    lambda e, s: e.batch_register_memory("abc", [16]),
    lambda e, s: e.transfer_sync_write(s, "a", 1 << 20, 16),
    lambda e, s: e.transfer_sync_write(123, 1 << 20, 1 << 20, 16),
    lambda e, s: e.batch_transfer_sync_write(s, [1 << 20], [1 << 20], [1.0]),
    lambda e, s: e.batch_transfer_async_read(s, [-1], [1 << 20], [16]),
    lambda e, s: e.get_batch_transfer_status(["x"]),
    lambda e, s: e.write_bytes_to_buffer(1 << 20, 42, 1),
    lambda e, s: e.transfer_sync(s, 1 << 20, 1 << 20, 16, "write"),
    lambda e, s: e.transfer_sync_write(s, 1 << 20, 1 << 20, 16, request_id="r"),
])
def test_wrong_types_raise_type_error(engine: TransferEngine, peer: script.Peer, call) -> None:
    """Arguments of the wrong type raise TypeError before anything is
    touched, as pybind11 does for Mooncake."""
    with pytest.raises(TypeError):
        call(engine, peer.session)


def test_engine_lifecycle_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before initialize() and after close() calls raise RuntimeError
    (Mooncake crashes there); a second initialize() and unsupported
    (redis, http) metadata servers return -1; "host:port" listens on that port;
    KVFERRY_PROTOCOL=rdma without a device is an error, not a fallback."""
    e = TransferEngine()
    with pytest.raises(RuntimeError, match="initialize"):
        e.get_rpc_port()
    with pytest.raises(RuntimeError):
        e.register_memory(1 << 20, 4096)
    with pytest.raises(RuntimeError):
        e.transfer_sync_write(f"{HOST}:1", 1 << 20, 1 << 20, 16)

    monkeypatch.delenv("KVFERRY_PROTOCOL", raising=False)
    assert e.initialize(HOST, "redis://127.0.0.1:6379", "tcp", "") == -1
    assert "P2PHANDSHAKE" in e.last_error()[1] and "etcd" in e.last_error()[1]
    assert e.initialize(HOST, "http://127.0.0.1:8080/metadata", "tcp", "") == -1
    monkeypatch.setenv("KVFERRY_PROTOCOL", "rdma")
    assert e.initialize(HOST, "P2PHANDSHAKE", "rdma", "mlx5_0") == -1
    assert "rdma" in e.last_error()[1] and "KVFERRY_PROTOCOL" in e.last_error()[1]
    monkeypatch.delenv("KVFERRY_PROTOCOL")
    assert e.initialize(f"{HOST}:notaport", "P2PHANDSHAKE", "tcp", "") == -1

    port = closed_port()
    assert e.initialize(f"{HOST}:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.get_rpc_port() == port
    assert e.get_session_id() == f"{HOST}:{port}"
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == -1  # already initialized

    b, local = buf(MiB)
    assert e.register_memory(local, MiB) == 0
    # A batch in flight at close() is canceled; close() returns once the
    # engine no longer touches our memory.
    assert e.batch_transfer_async_write(e.get_session_id(), [local], [local + MiB // 2], [MiB // 2]) != 0
    e.close()
    e.close()  # idempotent
    for call in (e.get_rpc_port, lambda: e.unregister_memory(local), lambda: e.get_batch_transfer_status([1]),
                 lambda: e.initialize(HOST, "P2PHANDSHAKE", "tcp", "")):
        with pytest.raises(RuntimeError):
            call()

    monkeypatch.setenv("KVFERRY_PROTOCOL", "tcp")  # read by initialize(), not at library load
    with TransferEngine() as f:
        assert f.initialize(HOST, "P2PHANDSHAKE", "rdma", "") == 0
    # An engine dropped without close() is destroyed by the garbage collector.
    g = TransferEngine()
    assert g.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    del g
    gc.collect()


def test_local_segment_and_request_ids(engine: TransferEngine) -> None:
    """Transfers to the engine's own session id (the local segment) and the
    request_id keyword on every transfer call."""
    b, local = buf(MiB)
    assert engine.register_memory(local, MiB) == 0
    try:
        data = pattern(12, 4096)
        ctypes.memmove(local, data, 4096)
        me = engine.get_session_id()
        assert engine.transfer_sync_write(me, local, local + 8192, 4096, request_id=5) == 0
        assert engine.transfer_sync_read(me, local + 16384, local + 8192, 4096, "tcp", request_id=5) == 0
        assert ctypes.string_at(local + 16384, 4096) == data
        n = 1000
        srcs = [local + (i % 64) * 64 for i in range(n)]
        dsts = [local + MiB // 2 + i * 64 for i in range(n)]
        assert engine.batch_transfer_sync_write(me, srcs, dsts, [64] * n, request_id=6) == 0
        got = ctypes.string_at(local + MiB // 2, n * 64)
        assert all(got[i * 64:(i + 1) * 64] == data[(i % 64) * 64:(i % 64 + 1) * 64] for i in range(n))
        bid = engine.batch_transfer_async_read(me, [local + 4096], [local], [4096], request_id=7)
        assert engine.get_batch_transfer_status([bid]) == 0
        assert ctypes.string_at(local + 4096, 4096) == data
    finally:
        assert engine.unregister_memory(local) == 0


def test_raw_buffer_copies_refuse_memory_not_ours() -> None:
    """write_bytes_to_buffer / read_bytes_from_buffer copy raw memory; an
    address that is not registered or allocated through the engine (0, a
    freed buffer) is an error, never a crash of the interpreter."""
    from kvferry.mooncake import TransferEngine

    with TransferEngine() as e:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = e.allocate_managed_buffer(1 << 16)
        assert buf != 0
        assert e.write_bytes_to_buffer(buf + 8, b"abc", 3) == 0
        assert e.read_bytes_from_buffer(buf + 8, 3) == b"abc"
        assert e.write_bytes_to_buffer(0, b"abc", 3) < 0
        assert e.write_bytes_to_buffer(buf + (1 << 16) - 1, b"abc", 3) < 0  # runs past the end
        with pytest.raises(ValueError):
            e.read_bytes_from_buffer(0, 3)
        assert e.free_managed_buffer(buf, 1 << 16) == 0
        assert e.write_bytes_to_buffer(buf, b"abc", 3) < 0  # freed: unmapped
        with pytest.raises(ValueError):
            e.read_bytes_from_buffer(buf, 3)


def test_startup_as_sglang_and_vllm_do(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's and vLLM's Mooncake wrappers pass "rdma" whatever the host
    has, and a host name: "rdma" without a device falls back to tcp with one
    WARNING that names the reason (Mooncake does the same), MC_FORCE_TCP=1
    forces tcp without one, "localhost" and the machine's name work and stay
    the session id, initialize_ext() takes the metadata type, and
    get_engine() gives the engine to share."""
    monkeypatch.delenv("KVFERRY_PROTOCOL", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvferry.mooncake"):
        with TransferEngine() as e:
            assert e.initialize("localhost", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0, e.last_error()
            assert e.get_session_id() == f"localhost:{e.get_rpc_port()}"
            assert e.get_engine() is e
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "falling back to tcp" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "rdma" in warnings[0].getMessage()

    caplog.clear()
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    with caplog.at_level(logging.WARNING, logger="kvferry.mooncake"):
        with TransferEngine() as owner, TransferEngine() as init:
            assert owner.initialize_ext("localhost", "P2PHANDSHAKE", "rdma", "", "p2p") == 0, owner.last_error()
            host = socket.gethostname()
            try:
                socket.getaddrinfo(host, None)
            except OSError:
                host = "localhost"  # the machine's name does not resolve here
            assert init.initialize(host, "P2PHANDSHAKE", "rdma", "") == 0, init.last_error()
            assert init.get_session_id().startswith(host + ":")
            b, dst = buf(MiB)
            c, src = buf(MiB)
            c[:] = bytes(range(256)) * (MiB // 256)
            assert owner.register_memory(dst, MiB) == 0
            assert init.register_memory(src, MiB) == 0
            assert init.transfer_sync_write(owner.get_session_id(), src, dst, MiB) == 0, init.last_error()
            assert bytes(b) == bytes(c)
            assert init.batch_transfer_sync_write(owner.get_session_id(), [src], [dst], [MiB]) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]

    with TransferEngine() as f:
        assert f.initialize_ext("localhost", "127.0.0.1:6379", "tcp", "", "redis") == -1
        assert "P2PHANDSHAKE" in f.last_error()[1] and "etcd" in f.last_error()[1]


def test_other_protocol_strings_take_what_the_host_offers(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """SGLang passes MOONCAKE_PROTOCOL through (efa, nvlink...), which
    Mooncake's usual build ignores: the shim takes what the host offers with
    one WARNING naming the string, and the other Mooncake attributes
    frameworks may touch are there (TransferOpcode on the class,
    warmup_efa_segment answering 0 as Mooncake without EFA does)."""
    monkeypatch.delenv("KVFERRY_PROTOCOL", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvferry.mooncake"):
        with TransferEngine() as e:
            assert e.initialize("localhost", "P2PHANDSHAKE", "efa", "") == 0, e.last_error()
            assert e.warmup_efa_segment(e.get_session_id()) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "'efa'" in warnings[0], warnings
    assert TransferEngine.TransferOpcode is TransferOpcode and TransferEngine.TransferOpcode.Write == 1


# ------------------------------------------------------- the supported alias

ALIAS = HERE.parent / "alias"


def _real_mooncake_installed() -> bool:
    import importlib.metadata as md

    names = {(d.metadata.get("Name") or "").lower() for d in md.distributions()}
    return bool(names & {"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "mooncake"})


def _alias_env(*paths: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("KVFERRY_PROTOCOL", None)
    env.pop("MC_FORCE_TCP", None)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [str(HERE.parent)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def test_alias_runs_the_sglang_script_unchanged() -> None:
    """With kvferry-mooncake-alias installed (here: on the path), SGLang's
    own import, ``from mooncake.engine import TransferEngine``, gives
    kvferry, and the SGLang-like script runs unchanged with "rdma" and
    "localhost" on a host without RDMA: one WARNING says rdma fell back to
    tcp, and every page verifies."""
    if _real_mooncake_installed():
        pytest.skip("a real Mooncake is installed in this interpreter: the alias refuses to load next to it "
                    "(test_alias_refuses_to_shadow_a_real_mooncake)")
    env = _alias_env(ALIAS, KVFERRY_SCRIPT_PROTOCOL="rdma", KVFERRY_SCRIPT_HOST="localhost")
    r = subprocess.run([sys.executable, str(HERE / "mooncake_shim_script.py"), "--impl", "mooncake"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), r.stdout + r.stderr
    assert "falling back to tcp" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "import mooncake.engine as m, kvferry.mooncake as k; "
                        "assert m.TransferEngine is k.TransferEngine; print('kvferry')"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "kvferry", r.stdout + r.stderr


def test_alias_refuses_to_shadow_a_real_mooncake(tmp_path: Path) -> None:
    """Next to an installed Mooncake (its distribution metadata is enough)
    the alias refuses to load, naming both, instead of silently shadowing
    Mooncake or being shadowed by it."""
    dist = tmp_path / "mooncake_transfer_engine-0.3.13.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-transfer-engine\nVersion: 0.3.13\n")
    r = subprocess.run([sys.executable, "-c", "from mooncake.engine import TransferEngine"],
                       capture_output=True, text=True, timeout=60, env=_alias_env(ALIAS, tmp_path))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "ImportError" in r.stderr and "mooncake-transfer-engine 0.3.13" in r.stderr \
        and "kvferry-mooncake-alias" in r.stderr, r.stderr
