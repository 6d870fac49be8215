#!/usr/bin/env python3
"""The SGLang-like disaggregation scenario, runnable against kvferry's shim or
the real Mooncake, unchanged:

    python mooncake_shim_script.py --impl kvferry
    python mooncake_shim_script.py --impl mooncake     # needs mooncake-transfer-engine(-non-cuda)
    python mooncake_shim_script.py --impl kvferry --fence-flow   # decode gives a room up mid-transfer

A spawned "decode" process registers its KV cache (K and V buffers of every
layer, with batch_register_memory) and an aux buffer, and hands its session
id ("host:port", built from get_rpc_port() as SGLang does) and buffer
addresses to this "prefill" process over a pipe (SGLang's bootstrap
channel). Prefill fills its own KV cache with a pattern and, for each request
("room"), sends the pages it computed into the decode pages the decode side
picked: one batch_transfer_sync_write over every layer's K and V, contiguous
page runs merged into one entry each (SGLang's
group_concurrent_contiguous), then the aux data with transfer_sync_write.
Decode then checks every destination page byte for byte against the pattern
and that no other page was touched. Prints PASS (exit 0) or FAIL (exit 1).

The module also provides ``peer_main``, the command loop of a peer process
that test_mooncake.py drives.

Process rule: children are started with the "spawn" method; a process that
loaded libkvferry.so (or Mooncake) must not fork() without exec.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import random
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

HOST = "127.0.0.1"
LAYERS = 8
PAGES = 256
PAGE_BYTES = 4096
ROOMS = 4
PAGES_PER_ROOM = 48
AUX_BYTES = 256


def engine_class(impl: str) -> type:
    """The TransferEngine class of an implementation: "kvferry" or "mooncake"."""
    if impl == "kvferry":
        try:
            from kvferry.mooncake import TransferEngine
        except ImportError:
            # Run from a checkout: the package lives next to tests/.
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from kvferry.mooncake import TransferEngine
        return TransferEngine
    if impl == "mooncake":
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

        return TransferEngine
    raise ValueError(f"unknown implementation {impl!r}")


def new_engine(impl: str, local_hostname: str = HOST) -> Any:
    """An initialized engine (P2PHANDSHAKE; tcp, or the protocol and host
    KVFERRY_SCRIPT_PROTOCOL and KVFERRY_SCRIPT_HOST name: SGLang passes
    "rdma" whatever the host has), as SGLang creates it."""
    engine = engine_class(impl)()
    local_hostname = os.environ.get("KVFERRY_SCRIPT_HOST", local_hostname)
    protocol = os.environ.get("KVFERRY_SCRIPT_PROTOCOL", "tcp")
    ret = engine.initialize(local_hostname, "P2PHANDSHAKE", protocol, "")
    if ret != 0:
        raise RuntimeError(f"{impl}: initialize returned {ret}")
    return engine


def layer_pattern(side: str, layer: int, kv: int) -> bytes:
    """The content prefill writes into one K or V buffer (PAGES pages)."""
    return random.Random(f"{side}/{layer}/{kv}").randbytes(PAGES * PAGE_BYTES)


def group_contiguous(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """SGLang's group_concurrent_contiguous: runs of pages contiguous on both
    sides as (src page, dst page, page count)."""
    runs: List[Tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class Memory:
    """Buffers of this process, kept alive until the process ends."""

    def __init__(self) -> None:
        self.keep: List[ctypes.Array] = []

    def alloc(self, size: int) -> int:
        buf = (ctypes.c_char * size)()
        self.keep.append(buf)
        return ctypes.addressof(buf)


def peer_main(impl: str, conn: Connection, local_hostname: str = HOST) -> None:
    """A peer process: creates an engine and serves commands from conn until
    ("exit",). Each command is a tuple (name, *args); the reply is ("ok",
    value) or ("error", traceback text)."""
    mem = Memory()
    try:
        engine = new_engine(impl, local_hostname)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", (os.environ.get("KVFERRY_SCRIPT_HOST", local_hostname), engine.get_rpc_port())))
    handlers = {
        "alloc": lambda size, register=True: _alloc(engine, mem, size, register),
        "alloc_kv": lambda layers, size: _alloc_kv(engine, mem, layers, size),
        "get": lambda addr, n: ctypes.string_at(addr, n),
        "put": lambda addr, data: ctypes.memmove(addr, data, len(data)) and None,
        "fill": lambda addr, n, byte: ctypes.memset(addr, byte, n) and None,
        "count_not": lambda addr, n, byte: n - ctypes.string_at(addr, n).count(bytes([byte])),
        "call": lambda method, *args, **kw: getattr(engine, method)(*args, **kw),
        "abort_then_fill": lambda rid, initiators, timeout, addr, n, byte:
            _abort_then_fill(engine, rid, initiators, timeout, addr, n, byte),
        "fence_then_fill": lambda addrs, lengths, timeout, addr, n, byte:
            _fence_then_fill(engine, addrs, lengths, timeout, addr, n, byte),
        "stats": lambda: _kvferry_stats(engine),
        "write_rooms": lambda session, rooms, threads: _write_rooms(engine, session, rooms, threads),
        "count": lambda addrs, n, byte: sum(ctypes.string_at(a, n).count(bytes([byte])) for a in addrs),
        "fill_pages": lambda addrs, n, byte: [ctypes.memset(a, byte, n) for a in addrs] and None,
        "pid": lambda: os.getpid(),
        "addrs": lambda: [ctypes.addressof(b) for b in mem.keep],
    }
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "exit":
            if hasattr(engine, "close"):
                engine.close()
            conn.send(("ok", None))
            return
        try:
            name, args = msg[0], msg[1:]
            kwargs: Dict[str, Any] = {}
            if args and isinstance(args[-1], dict) and name == "call":
                kwargs = args[-1]
                args = args[:-1]
            conn.send(("ok", handlers[name](*args, **kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _alloc(engine: Any, mem: Memory, size: int, register: bool) -> int:
    addr = mem.alloc(size)
    if register and engine.register_memory(addr, size) != 0:
        raise RuntimeError("register_memory failed")
    return addr


def _alloc_kv(engine: Any, mem: Memory, layers: int, size: int) -> List[int]:
    """K and V buffers of every layer, registered in one batch_register_memory."""
    addrs = [mem.alloc(size) for _ in range(2 * layers)]
    if engine.batch_register_memory(addrs, [size] * len(addrs)) != 0:
        raise RuntimeError("batch_register_memory failed")
    return addrs


def _abort_then_fill(engine: Any, rid: int, initiators: List[str], timeout: float, addr: int, n: int,
                     byte: int) -> Tuple[int, float]:
    """Owner side of the PD abort: aborts rid, and when it is safe reuses the
    slots at once (fills them). Returns (abort's return, seconds it took)."""
    return _timed_then_fill(lambda: engine.abort(rid, initiators, timeout), addr, n, byte)


def _fence_then_fill(engine: Any, addrs: List[int], lengths: List[int], timeout: float, addr: int, n: int,
                     byte: int) -> Tuple[int, float]:
    """Owner side of a fence by memory range (kvferry only): fences the
    ranges, and when it is safe reuses [addr, +n) at once (fills it).
    Returns (fence_memory's return, seconds it took)."""
    return _timed_then_fill(lambda: engine.fence_memory(addrs, lengths, timeout), addr, n, byte)


def _timed_then_fill(call: Callable[[], int], addr: int, n: int, byte: int) -> Tuple[int, float]:
    """Runs call (an abort or a fence) and, when it returned 0 (safe), fills
    [addr, +n) with byte at once. Returns (call's return, seconds it took)."""
    t = time.perf_counter()
    ret = call()
    took = time.perf_counter() - t
    if ret == 0:
        ctypes.memset(addr, byte, n)
    return ret, took


def _write_rooms(engine: Any, session: str, rooms: List[Tuple[List[int], List[int], List[int]]],
                 threads: int) -> List[int]:
    """Prefill as SGLang's conn.py sends KV: each room is one
    batch_transfer_sync_write (source pages, destination pages, lengths; no
    request id), the rooms run at once on a pool of threads. Returns each
    room's return code, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(engine.batch_transfer_sync_write, session, srcs, dsts, lens)
                   for srcs, dsts, lens in rooms]
        return [f.result() for f in futures]


def _kvferry_stats(engine: Any) -> Dict[str, int]:
    """The counters of a kvferry engine (kvf_engine_stats), by field name."""
    from kvferry import _lib

    s = _lib.Stats()
    s.struct_size = ctypes.sizeof(s)
    if engine._lib.kvf_engine_stats(engine._engine, ctypes.byref(s)) != 0:
        raise RuntimeError(engine._lib.kvf_last_error().decode())
    return {name: getattr(s, name) for name, _ in s._fields_}


class Peer:
    """The parent's handle on a spawned peer process."""

    def __init__(self, impl: str, local_hostname: str = HOST) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(impl, child, local_hostname), daemon=True)
        self.proc.start()
        child.close()
        host, port = self._reply(60)
        # The session id the SGLang way: "<host>:<get_rpc_port()>".
        self.session = f"{host}:{port}"

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("peer did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer failed:\n{value}")
        return value

    def __call__(self, *cmd: Any, timeout: float = 60) -> Any:
        self.conn.send(cmd)
        return self._reply(timeout)

    def start(self, *cmd: Any) -> None:
        """Sends a command without waiting; take its answer with result()."""
        self.conn.send(cmd)

    def result(self, timeout: float = 60) -> Any:
        """The answer to the command start() sent."""
        return self._reply(timeout)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls a TransferEngine method in the peer."""
        return self("call", method, *args, kwargs)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("exit", timeout=20)
            except Exception:
                pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def run_scenario(impl: str, seed: int = 1, verbose: bool = True) -> bool:
    """The SGLang-like scenario (see the module docstring). True on PASS."""
    rng = random.Random(seed)
    size = PAGES * PAGE_BYTES
    try:
        decode = Peer(impl)
    except Exception:
        traceback.print_exc()
        return False
    ok = True
    try:
        prefill = new_engine(impl)
        mem = Memory()
        # Decode: KV cache and aux buffer; their addresses go to prefill with
        # the session id, as in SGLang's bootstrap.
        dst_kv = decode("alloc_kv", LAYERS, size)
        dst_aux = decode("alloc", AUX_BYTES * ROOMS)
        # Prefill: its KV cache, computed (filled) before the transfers.
        src_kv = [mem.alloc(size) for _ in range(2 * LAYERS)]
        if prefill.batch_register_memory(src_kv, [size] * len(src_kv)) != 0:
            raise RuntimeError("prefill batch_register_memory failed")
        for i, addr in enumerate(src_kv):
            data = layer_pattern("prefill", i // 2, i % 2)
            ctypes.memmove(addr, data, size)
        src_aux = mem.alloc(AUX_BYTES * ROOMS)
        if prefill.register_memory(src_aux, AUX_BYTES * ROOMS) != 0:
            raise RuntimeError("prefill register_memory failed")

        free_dst = list(range(PAGES))
        rng.shuffle(free_dst)
        expected: Dict[int, Tuple[int, int]] = {}  # dst page -> (src page, room)
        entries = 0
        t0 = time.perf_counter()
        for room in range(ROOMS):
            src_pages = sorted(rng.sample(range(PAGES), PAGES_PER_ROOM))
            # Decode hands out pages partly contiguous, partly scattered.
            dst_pages = sorted(free_dst[:PAGES_PER_ROOM])
            del free_dst[:PAGES_PER_ROOM]
            srcs: List[int] = []
            dsts: List[int] = []
            lens: List[int] = []
            for layer_buf in range(2 * LAYERS):
                for s, d, n in group_contiguous(src_pages, dst_pages):
                    srcs.append(src_kv[layer_buf] + s * PAGE_BYTES)
                    dsts.append(dst_kv[layer_buf] + d * PAGE_BYTES)
                    lens.append(n * PAGE_BYTES)
            ret = prefill.batch_transfer_sync_write(decode.session, srcs, dsts, lens)
            if ret != 0:
                raise RuntimeError(f"room {room}: batch_transfer_sync_write returned {ret}")
            entries += len(srcs)
            aux = bytes([room + 1]) * AUX_BYTES
            ctypes.memmove(src_aux + room * AUX_BYTES, aux, AUX_BYTES)
            ret = prefill.transfer_sync_write(decode.session, src_aux + room * AUX_BYTES,
                                              dst_aux + room * AUX_BYTES, AUX_BYTES)
            if ret != 0:
                raise RuntimeError(f"room {room}: transfer_sync_write (aux) returned {ret}")
            for s, d in zip(src_pages, dst_pages):
                expected[d] = (s, room)
        elapsed = time.perf_counter() - t0

        # Decode side: verify every page of every layer, byte for byte.
        bad = 0
        for i, addr in enumerate(dst_kv):
            got = decode("get", addr, size)
            src = layer_pattern("prefill", i // 2, i % 2)
            for page in range(PAGES):
                g = got[page * PAGE_BYTES:(page + 1) * PAGE_BYTES]
                if page in expected:
                    s = expected[page][0]
                    want = src[s * PAGE_BYTES:(s + 1) * PAGE_BYTES]
                else:
                    want = bytes(PAGE_BYTES)  # never a destination: untouched
                if g != want:
                    bad += 1
        aux_got = decode("get", dst_aux, AUX_BYTES * ROOMS)
        aux_want = b"".join(bytes([r + 1]) * AUX_BYTES for r in range(ROOMS))
        if aux_got != aux_want:
            bad += 1
        ok = bad == 0
        if verbose:
            print(f"{impl}: {ROOMS} rooms, {entries} batch entries ({LAYERS} layers x K/V, "
                  f"{PAGES_PER_ROOM} pages of {PAGE_BYTES} B each), {elapsed * 1e3:.1f} ms; "
                  f"{bad} mismatched pages")
        if hasattr(prefill, "close"):
            prefill.close()
    except Exception:
        traceback.print_exc()
        ok = False
    finally:
        decode.close()
    return ok


def run_fence_flow(impl: str, room_bytes: int = 256 << 20, page: int = 64 << 10, attempts: int = 3,
                   fence: bool = True) -> Dict[str, Any]:
    """SGLang's PD flow with decode giving a room up mid-transfer, in two
    spawned processes: decode registers a KV pool; prefill sends four rooms
    at once from a pool of threads, each one batch_transfer_sync_write of
    scattered pages without a request id (room A large, three bystanders
    small). When A's first bytes have landed, decode gives A up: it fences
    A's pages (kvferry's fence_memory; with fence False, or on Mooncake,
    which has none, it does not) and reuses them at once with its own
    bytes. Then the next room is written into A's pages, told to prefill
    only now, as decode's bootstrap does. Returns what each attempt saw;
    attempts stop once the fence struck while A was in flight."""
    decode, prefill = Peer(impl), Peer(impl)
    try:
        n = room_bytes // page
        small = 16
        pool = decode("alloc", (2 * n + 4 * small) * page)
        src = prefill("alloc", (n + 4 * small + n) * page)
        # A takes every other page of the first 2n; the bystanders the pages
        # after; the next room A's pages again.
        a_pages = [pool + 2 * i * page for i in range(n)]
        b_pages = [[pool + (2 * n + r * small + i) * page for i in range(small)] for r in range(3)]
        a_src = [src + i * page for i in range(n)]
        b_src = [[src + (n + r * small + i) * page for i in range(small)] for r in range(3)]
        next_src = [src + (n + 4 * small + i) * page for i in range(n)]
        prefill("fill", src, n * page, 0x44)
        for r in range(3):
            prefill("fill", b_src[r][0], small * page, 0x61 + r)
        prefill("fill", next_src[0], n * page, 0x55)
        rooms = [(a_src, a_pages, [page] * n)] + [(b_src[r], b_pages[r], [page] * small) for r in range(3)]
        out: List[Dict[str, Any]] = []
        for _ in range(attempts):
            decode("fill", pool, (2 * n + 4 * small) * page, 0)
            prefill.start("write_rooms", decode.session, rooms, 4)
            deadline = time.monotonic() + 60
            probe = a_pages[::max(1, n // 64)]  # 64 pages across the room: the order pages land in is the engine's
            # Until A's first bytes landed, or prefill's rooms ended without
            # them (an engine that fails the room outright).
            while decode("count", probe, page, 0x44) == 0 and not prefill.conn.poll(0):
                if time.monotonic() > deadline:
                    raise TimeoutError("no byte of room A landed within 60 s")
            fence_ret, took = None, 0.0
            if fence:
                t = time.perf_counter()
                fence_ret = decode("call", "fence_memory", a_pages, [page] * n, 5.0)
                took = time.perf_counter() - t
            decode("fill_pages", a_pages, page, 0xAB)  # reused at once
            rets = prefill.result(300)
            corrupt = decode("count", a_pages, page, 0x44)
            bystanders_ok = all(decode("count", b_pages[r], page, 0x61 + r) == small * page for r in range(3))
            next_ret = prefill("write_rooms", decode.session, [(next_src, a_pages, [page] * n)], 1)[0]
            next_ok = decode("count", a_pages, page, 0x55) == n * page
            out.append({"room_a": rets[0], "bystanders": rets[1:], "bystanders_ok": bystanders_ok,
                        "fence": fence_ret, "fence_s": round(took, 4), "corrupt_bytes": corrupt,
                        "next": next_ret, "next_ok": next_ok})
            if rets[0] != 0:
                break
        return {"impl": impl, "fence": fence, "attempts": out}
    finally:
        prefill.close()
        decode.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("kvferry", "mooncake"), default="kvferry")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fence-flow", action="store_true",
                    help="run the PD flow where decode gives a room up mid-transfer (run_fence_flow); print JSON")
    ap.add_argument("--no-fence", action="store_true", help="with --fence-flow: decode does not fence")
    ap.add_argument("--room-mib", type=int, default=256, help="with --fence-flow: the given-up room's size")
    args = ap.parse_args(argv)
    if args.fence_flow:
        import json

        print(json.dumps(run_fence_flow(args.impl, room_bytes=args.room_mib << 20,
                                        fence=args.impl == "kvferry" and not args.no_fence)))
        return 0
    ok = run_scenario(args.impl, args.seed)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
