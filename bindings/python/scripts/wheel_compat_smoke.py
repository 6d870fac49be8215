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
import sys
from pathlib import Path

SIZE = 4 << 20


def fail(msg: str) -> None:
    print(f"wheel_compat_smoke: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def mapped_libraries() -> list:
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and ".so" in parts[5]:
                paths.add(parts[5].strip())
    return sorted(paths)


def main() -> None:
    if "KVFERRY_LIBRARY" in os.environ:
        fail("KVFERRY_LIBRARY is set: the wheel's own library would not be the one tested")
    import kvferry
    from kvferry import Engine

    pkg = Path(kvferry.__file__).resolve().parent
    if "site-packages" not in str(pkg):
        fail(f"kvferry imported from {pkg}, not from an installed package")

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
