"""Smoke test of an installed manylinux_2_28 kvferry wheel (make wheel-compat).

Run with the venv's python from outside the source tree. It loads the
installed package (never the source tree, never $KVFERRY_LIBRARY), checks
that libkvferry.so came from the package, then through the public API moves
4 MiB of random bytes between two engines on loopback: a WRITE into the
peer's registered buffer and a READ back into a second local buffer, each
checked byte for byte. Last it reads /proc/self/maps: libzmq is linked into
libkvferry.so, so no libzmq*.so may be mapped at all (no system copy was
loaded behind the wheel's back). Exits non-zero on any failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import _smoke_common
from _smoke_common import installed_package, mapped_libraries

SIZE = 4 << 20


def fail(msg: str) -> None:
    _smoke_common.fail("wheel_compat_smoke", msg)


def main() -> None:
    pkg = installed_package("wheel_compat_smoke")
    import kvferry
    from kvferry import Engine

    payload = os.urandom(SIZE)
    with Engine() as owner, Engine() as peer:
        remote = bytearray(SIZE)                 # the owner's memory, written then read
        remote_addr = owner.register(remote)
        src = peer.alloc_buffer(SIZE)
        back = peer.alloc_buffer(SIZE)
        src.write(payload)
        seg = peer.open_segment(owner.name)
        peer.write(seg, src, remote_addr, SIZE, request_id=1)
        if bytes(remote) != payload:
            fail("WRITE: the peer's buffer differs from what was sent")
        peer.read(seg, back, remote_addr, SIZE, request_id=2)
        if back.read() != payload:
            fail("READ: what came back differs from what was written")
        print(f"wheel_compat_smoke: libkvferry {kvferry.library_version()}: "
              f"{SIZE >> 20} MiB written to {owner.name} and read back, byte for byte")

    maps = mapped_libraries()
    lib = [p for p in maps if os.path.basename(p).startswith("libkvferry")]
    if not lib or any(Path(p).resolve().parent != pkg for p in lib):
        fail(f"libkvferry mapped from {lib}, not from the package {pkg}")
    zmq = [p for p in maps if os.path.basename(p).startswith("libzmq")]
    if zmq:
        fail(f"a libzmq shared library was loaded: {zmq} (the wheel's library has libzmq linked in)")
    print(f"wheel_compat_smoke: libkvferry mapped from {lib[0]}; no libzmq*.so mapped")
    print("wheel_compat_smoke: OK")


if __name__ == "__main__":
    main()
