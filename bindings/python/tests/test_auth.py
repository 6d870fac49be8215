"""Authentication through the Python binding: engines sharing a cluster
secret (or listing each other's keys) move data; an engine with another key
is refused with UnauthenticatedError before anything moves; the allowlist
reloads, and a peer it drops is cut."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import pytest

import kvferry
from _helpers import assert_bytes_equal, pattern


def _private(path: Path, text: str) -> str:
    path.write_text(text)
    os.chmod(path, 0o600)
    return str(path)


def _keypair() -> tuple:
    """A CURVE key pair (public, secret) in Z85, made by libzmq's
    zmq_curve_keypair, as an operator's ZeroMQ tools would (`kvferry keygen`
    makes the same)."""
    zmq = ctypes.CDLL(ctypes.util.find_library("zmq") or "libzmq.so.5")
    pub, sec = ctypes.create_string_buffer(41), ctypes.create_string_buffer(41)
    assert zmq.zmq_curve_keypair(pub, sec) == 0, "libzmq without CURVE"
    return pub.value.decode(), sec.value.decode()


def _move(init: kvferry.Engine, owner: kvferry.Engine, n: int = 1 << 20) -> None:
    dst = owner.alloc_buffer(n)
    src = init.alloc_buffer(n)
    data = pattern(5, n)
    src.write(data)
    seg = init.open_segment(owner.name, timeout=10)
    init.transfer_sync([kvferry.Request(kvferry.Op.WRITE, src.addr, seg, dst.addr, n)], timeout=10)
    assert_bytes_equal(dst.read(), data, "the write")


def test_engines_sharing_a_cluster_secret_move_data_and_others_are_refused(tmp_path: Path) -> None:
    shared = _private(tmp_path / "shared", "the cluster's shared secret, 32+ bytes")
    other = _private(tmp_path / "other", "another cluster's secret, 32+ bytes")
    with kvferry.Engine(cluster_secret_file=shared, ignore_env=True) as a, \
            kvferry.Engine(cluster_secret_file=shared, ignore_env=True) as b, \
            kvferry.Engine(cluster_secret_file=other, ignore_env=True, log_level="off") as c:
        assert a.public_key == b.public_key != c.public_key
        assert len(a.public_key) == 40
        _move(a, b)
        with pytest.raises(kvferry.UnauthenticatedError):
            c.open_segment(a.name, timeout=5)
        assert c.stats().auth_refused >= 1  # c does not know a's key: it refuses to talk
        with pytest.raises(kvferry.InvalidArgumentError):
            a.reload_allowlist(timeout=1)  # a cluster secret has no allowlist file


def test_an_engine_without_authentication_has_no_public_key() -> None:
    with kvferry.Engine(ignore_env=True) as e:
        assert e.public_key is None
        with pytest.raises(kvferry.InvalidArgumentError):
            e.reload_allowlist(timeout=1)


def test_allowlists_reload_and_cut_a_dropped_peer(tmp_path: Path) -> None:
    keys = {}
    for name in ("owner", "a", "b"):
        pub, sec = _keypair()
        keys[name] = (_private(tmp_path / f"{name}.key", sec + "\n"), pub)

    def allow(name: str, *peers: str) -> str:
        return _private(tmp_path / f"{name}.allow", "".join(keys[p][1] + f" {p}\n" for p in peers))

    owner_allow = allow("owner", "a", "b")
    with kvferry.Engine(secret_key_file=keys["owner"][0], allowlist_file=owner_allow, ignore_env=True) as owner, \
            kvferry.Engine(secret_key_file=keys["a"][0], allowlist_file=allow("a", "owner"), ignore_env=True,
                           log_level="off") as a, \
            kvferry.Engine(secret_key_file=keys["b"][0], allowlist_file=allow("b", "owner"), ignore_env=True) as b:
        assert owner.public_key == keys["owner"][1]
        _move(a, owner)
        _move(b, owner)
        _private(Path(owner_allow), keys["b"][1] + "\n")
        owner.reload_allowlist(timeout=10)
        with pytest.raises(kvferry.KvferryError):
            _move(a, owner)
        _move(b, owner)
        assert owner.stats().auth_refused >= 1
