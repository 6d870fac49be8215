"""Smoke test of an installed kvferry wheel, run by check_wheel.sh.

Loads libkvferry.so from the installed package (never the source tree, never
$KVFERRY_LIBRARY), moves 1 MiB between two engines over the control plane
(libzmq) and TCP, checks it byte for byte, and then reads /proc/self/maps to
show where libzmq was actually loaded from. Exits non-zero on any failure.

It uses kvferry._lib, the ctypes layer, so that it checks the packaging and
the native libraries alone, whatever the state of the high-level API.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import _smoke_common
from _smoke_common import installed_package, mapped_libraries

# include/kvferry.h: KVF_OP_WRITE = 1. Spelled out here rather than taken from
# kvferry._lib, so that this check depends on the header's ABI alone.
KVF_OP_WRITE = 1


def fail(msg: str) -> None:
    _smoke_common.fail("wheel_smoke", msg)


def main() -> None:
    pkg = installed_package("wheel_smoke")
    from kvferry import _lib

    libs_dir = pkg.parent / "kvferry.libs"
    L = _lib.lib()
    lib_path = Path(L._name).resolve()
    if lib_path.parent != pkg:
        fail(f"libkvferry loaded from {lib_path}, not from the package {pkg}")
    print(f"wheel_smoke: libkvferry {L.kvf_version_string().decode()} from {lib_path}")

    def engine() -> ctypes.c_void_p:
        opts = _lib.EngineOptions()
        opts.struct_size = ctypes.sizeof(opts)
        opts.flags = _lib.ENGINE_IGNORE_ENV
        h = ctypes.c_void_p()
        _lib.check(L.kvf_engine_create(ctypes.byref(opts), ctypes.byref(h)))
        return h

    a, b = engine(), engine()
    try:
        n = 1 << 20
        src = (ctypes.c_uint8 * n).from_buffer(bytearray(os.urandom(n)))
        dst = (ctypes.c_uint8 * n)()
        _lib.check(L.kvf_register_memory(a, ctypes.addressof(src), n, b"cpu"))
        _lib.check(L.kvf_register_memory(b, ctypes.addressof(dst), n, b"cpu"))
        name = _lib.read_string(L.kvf_engine_name, b)
        seg = ctypes.c_void_p()
        _lib.check(L.kvf_open_segment(a, name.encode(), 5000, ctypes.byref(seg)))
        req = _lib.Request(op=KVF_OP_WRITE, local=ctypes.addressof(src), segment=seg,
                           remote=ctypes.addressof(dst), length=n, request_id=1)
        st = _lib.TaskStatus()
        _lib.check(L.kvf_transfer_sync(a, ctypes.byref(req), 1, 10000, ctypes.byref(st)))
        if bytes(dst) != bytes(src):
            fail("the 1 MiB written to the peer differs from the source")
        print(f"wheel_smoke: 1 MiB written to {name} over tcp and verified")
        _lib.check(L.kvf_close_segment(seg))
    finally:
        _lib.check(L.kvf_engine_destroy(a))
        _lib.check(L.kvf_engine_destroy(b))

    zmq = [p for p in mapped_libraries() if os.path.basename(p).startswith("libzmq")]
    if not zmq:
        fail("no libzmq mapped at all")
    for p in zmq:
        if Path(p).resolve().parent != libs_dir.resolve():
            fail(f"libzmq mapped from {p}, outside the wheel's {libs_dir}")
    print(f"wheel_smoke: libzmq mapped only from the wheel: {', '.join(zmq)}")
    print("wheel_smoke: OK")


if __name__ == "__main__":
    main()
