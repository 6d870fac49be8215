#!/usr/bin/env python3
"""kvferry's Mooncake shim against the real Mooncake, same workload, same
machine: batch_transfer_sync_write between two processes over TCP.

    python bench/side_by_side.py --mooncake-python /tmp/mcvenv/bin/python --rounds 5

Workloads (each one batch_transfer_sync_write call per batch, repeated for
--seconds after one warm-up batch): 1,000 x 64 KiB and 64 x 4 MiB. Each
implementation runs in its own pair of processes (a fresh worker interpreter
that spawns the target); rounds alternate which implementation goes first.
After the timed loop the target's bytes are checked against the source (a
mismatch fails the run). GB/s are 1e9 bytes per second; the summary gives the
median of the rounds and the ratio kvferry/mooncake.

--local-overhead measures instead the Python cost of the shim: a
batch_transfer_sync_write of 1,000 x 4 KiB to the engine's own session id
(the local segment, a memcpy), in microseconds per entry, with the part
spent in Python (argument conversion and packing of the kvf_request array)
shown separately.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import mmap
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

KiB, MiB = 1 << 10, 1 << 20
HOST = "127.0.0.1"
BUFFER = 256 * MiB
WORKLOADS: List[Tuple[str, int, int]] = [("1000x64KiB", 1000, 64 * KiB), ("64x4MiB", 64, 4 * MiB)]


def engine_class(impl: str) -> type:
    if impl == "kvferry":
        try:
            from kvferry.mooncake import TransferEngine
        except ImportError:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from kvferry.mooncake import TransferEngine
        return TransferEngine
    from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

    return TransferEngine


def new_engine(impl: str) -> Any:
    e = engine_class(impl)()
    if e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"{impl}: initialize failed")
    return e


def alloc(size: int, fill: int) -> Tuple[mmap.mmap, int]:
    """Page-aligned anonymous memory, touched (filled) so that no page fault
    lands in the timed loop."""
    m = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    ctypes.memset(addr, fill, size)
    return m, addr


def target_main(impl: str, conn: Any) -> None:
    """The receiving process: a registered buffer, then digests on request."""
    e = new_engine(impl)
    m, addr = alloc(BUFFER, 0)
    if e.register_memory(addr, BUFFER) != 0:
        raise RuntimeError("register_memory failed")
    conn.send((f"{HOST}:{e.get_rpc_port()}", addr))
    while True:
        msg = conn.recv()
        if msg[0] == "digest":
            _, off, n = msg
            conn.send(hashlib.sha256(ctypes.string_at(addr + off, n)).hexdigest())
        else:
            conn.send(None)
            return


def worker(impl: str, seconds: float) -> Dict[str, Any]:
    """One run of every workload for impl: returns {workload: GB/s}."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(impl, child), daemon=True)
    proc.start()
    session, remote = conn.recv()
    e = new_engine(impl)
    m, local = alloc(BUFFER, 0)
    # A pattern that differs per 4 KiB page, so misplaced bytes show.
    page = bytes(range(256)) * 16
    for off in range(0, BUFFER, 4096):
        ctypes.memmove(local + off, page[(off // 4096) % 256:] + page[:(off // 4096) % 256], 4096)
    if e.register_memory(local, BUFFER) != 0:
        raise RuntimeError("register_memory failed")
    out: Dict[str, Any] = {"impl": impl}
    try:
        for name, n, size in WORKLOADS:
            srcs = [local + i * size for i in range(n)]
            dsts = [remote + i * size for i in range(n)]
            lens = [size] * n
            if e.batch_transfer_sync_write(session, srcs, dsts, lens) != 0:  # warm-up: session, connections
                raise RuntimeError(f"{impl} {name}: warm-up failed")
            batches = 0
            t0 = time.perf_counter()
            while True:
                if e.batch_transfer_sync_write(session, srcs, dsts, lens) != 0:
                    raise RuntimeError(f"{impl} {name}: transfer failed")
                batches += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds and batches >= 3:
                    break
            out[name] = batches * n * size / elapsed / 1e9
            conn.send(("digest", 0, n * size))
            if conn.recv() != hashlib.sha256(ctypes.string_at(local, n * size)).hexdigest():
                raise RuntimeError(f"{impl} {name}: data mismatch at the target")
    finally:
        conn.send(("exit",))
        conn.recv()
        proc.join(30)
    return out


def local_overhead(impl: str, iters: int) -> Dict[str, float]:
    """us/entry of batch_transfer_sync_write(1,000 x 4 KiB) to our own session."""
    e = new_engine(impl)
    m, addr = alloc(16 * MiB, 1)
    if e.register_memory(addr, 16 * MiB) != 0:
        raise RuntimeError("register_memory failed")
    me = f"{HOST}:{e.get_rpc_port()}"
    n, size = 1000, 4 * KiB
    srcs = [addr + i * size for i in range(n)]
    dsts = [addr + 8 * MiB + i * size for i in range(n)]
    lens = [size] * n
    for _ in range(5):
        assert e.batch_transfer_sync_write(me, srcs, dsts, lens) == 0
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        e.batch_transfer_sync_write(me, srcs, dsts, lens)
        times.append(time.perf_counter() - t)
    res = {"call_us_per_entry": statistics.median(times) / n * 1e6}
    if impl == "kvferry":
        # The Python part alone: argument conversion and kvf_request packing.
        seg = e._open(me)
        pt = []
        for _ in range(iters):
            t = time.perf_counter()
            src, dst, ln = e._arrays(srcs, dsts, lens)
            e._pack(1, seg, src, dst, ln, 0)
            pt.append(time.perf_counter() - t)
        res["python_us_per_entry"] = statistics.median(pt) / n * 1e6
    return res


def python_for(impl: str, args: argparse.Namespace) -> str:
    if impl == "mooncake":
        if args.mooncake_python:
            return args.mooncake_python
        if importlib.util.find_spec("mooncake") is not None:
            return sys.executable
        return ""
    return args.kvferry_python or sys.executable


def run_worker(python: str, impl: str, args: argparse.Namespace) -> Dict[str, Any]:
    mode = ["--local-overhead"] if args.local_overhead else []
    r = subprocess.run([python, str(Path(__file__).resolve()), "--worker", impl, "--seconds", str(args.seconds),
                        "--iters", str(args.iters)] + mode, capture_output=True, text=True, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} worker failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per implementation")
    ap.add_argument("--seconds", type=float, default=1.5, help="timed seconds per workload and run")
    ap.add_argument("--iters", type=int, default=200, help="calls timed by --local-overhead")
    ap.add_argument("--mooncake-python", default="", help="a Python with mooncake-transfer-engine(-non-cuda)")
    ap.add_argument("--kvferry-python", default="", help="a Python with kvferry (default: this one)")
    ap.add_argument("--local-overhead", action="store_true", help="measure the shim's per-entry overhead")
    ap.add_argument("--worker", choices=("kvferry", "mooncake"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        res = (local_overhead(args.worker, args.iters) if args.local_overhead
               else worker(args.worker, args.seconds))
        res["impl"] = args.worker
        print(json.dumps(res))
        return 0

    impls = [i for i in ("kvferry", "mooncake") if python_for(i, args)]
    if "mooncake" not in impls:
        print("mooncake: not importable here; pass --mooncake-python (pip install "
              "mooncake-transfer-engine-non-cuda in a venv). Running kvferry alone.")
    results: Dict[str, List[Dict[str, Any]]] = {i: [] for i in impls}
    for r in range(args.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for impl in order:
            res = run_worker(python_for(impl, args), impl, args)
            results[impl].append(res)
            print(f"round {r + 1} {impl}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in res.items() if k != "impl"), flush=True)

    keys = [k for k in results[impls[0]][0] if k != "impl"]
    unit = "us/entry" if args.local_overhead else "GB/s"
    print(f"\nmedian of {args.rounds} rounds ({unit}):")
    print(f"{'workload':<22}" + "".join(f"{i:>12}" for i in impls) + ("   kvferry/mooncake" if len(impls) == 2 else ""))
    for k in keys:
        med = {i: statistics.median(x[k] for x in results[i] if k in x) for i in impls if k in results[i][0]}
        line = f"{k:<22}" + "".join(f"{med[i]:>12.3f}" if i in med else f"{'-':>12}" for i in impls)
        if len(med) == 2:
            line += f"   {med['kvferry'] / med['mooncake']:>15.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
