"""The Mooncake shim with an etcd metadata server, as SGLang and vLLM
configure Mooncake: two engines that share only the etcd endpoint find each
other by session id and move data, whether the server is given as Mooncake's
bare "host:port" or as "etcd://host:port"; with etcd killed, the peer already
resolved keeps taking data.

The test starts its own etcd (Debian's etcd-server, which `make deps`
installs) on free ports, and skips, saying so, where there is none."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers import pattern  # noqa: E402
from kvferry.mooncake import TransferEngine  # noqa: E402

MiB = 1 << 20
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1) as r:
            return b'"health":"true"' in r.read()
    except OSError:
        return False


@pytest.fixture()
def etcd() -> Iterator[Tuple[subprocess.Popen, int]]:
    binary = os.environ.get("KVFERRY_ETCD") or shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not binary:
        pytest.skip("no etcd server (install Debian's etcd-server package, as `make deps` does, or set KVFERRY_ETCD)")
    with tempfile.TemporaryDirectory() as d:
        client, peer = _free_port(), _free_port()
        c, p = f"http://{HOST}:{client}", f"http://{HOST}:{peer}"
        proc = subprocess.Popen([binary, "--name", "t", "--data-dir", os.path.join(d, "data"),
                                 "--listen-client-urls", c, "--advertise-client-urls", c,
                                 "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                 "--initial-cluster", f"t={p}", "--log-level", "warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not _healthy(client):
                assert proc.poll() is None, f"etcd exited with {proc.returncode}"
                assert time.monotonic() < deadline, "etcd not healthy within 30 s"
                time.sleep(0.05)  # polling its health endpoint: the condition itself is awaited
            yield proc, client
        finally:
            proc.kill()
            proc.wait()


def _buf(size: int) -> Tuple[ctypes.Array, int]:
    b = (ctypes.c_char * size)()
    return b, ctypes.addressof(b)


@pytest.mark.parametrize("form", ["bare", "url", "initialize_ext"])
def test_engines_sharing_only_etcd_find_each_other(etcd: Tuple[subprocess.Popen, int], form: str) -> None:
    proc, port = etcd
    server = {"bare": f"{HOST}:{port}", "url": f"etcd://{HOST}:{port}", "initialize_ext": f"{HOST}:{port}"}[form]
    with TransferEngine() as owner, TransferEngine() as init:
        for e in (owner, init):
            if form == "initialize_ext":
                assert e.initialize_ext(HOST, server, "tcp", "", "etcd") == 0, e.last_error()
            else:
                assert e.initialize(HOST, server, "tcp", "") == 0, e.last_error()
        dst_b, dst = _buf(MiB)
        src_b, src = _buf(MiB)
        data = pattern(7, MiB)
        ctypes.memmove(src, data, MiB)
        assert owner.register_memory(dst, MiB) == 0
        assert init.register_memory(src, MiB) == 0
        assert init.transfer_sync_write(owner.get_session_id(), src, dst, MiB) == 0, init.last_error()
        assert bytes(dst_b) == data

        if form != "url":
            return
        # The store goes away: the resolved peer keeps taking data.
        proc.kill()
        proc.wait()
        data = pattern(8, MiB)
        ctypes.memmove(src, data, MiB)
        assert init.transfer_sync_write(owner.get_session_id(), src, dst, MiB) == 0, init.last_error()
        assert bytes(dst_b) == data


def test_a_session_not_in_the_store_is_not_found(etcd: Tuple[subprocess.Popen, int]) -> None:
    """Resolution goes through the store: an engine that did not publish
    there (it uses the P2P handshake) is not found by one that uses etcd,
    though it listens."""
    _, port = etcd
    with TransferEngine() as p2p, TransferEngine() as init:
        assert p2p.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        assert init.initialize(HOST, f"{HOST}:{port}", "tcp", "") == 0
        b, dst = _buf(MiB)
        assert p2p.register_memory(dst, MiB) == 0
        c, src = _buf(MiB)
        assert init.register_memory(src, MiB) == 0
        assert init.transfer_sync_write(p2p.get_session_id(), src, dst, 4096) != 0
        assert "metadata store" in init.last_error()[1], init.last_error()
