"""Review tests of PrometheusMirror: what it writes must add up to what the
engine reports, while the engine's peer labels come and go.

The engine gives at most MetricsPeers peers a label of their own; a peer idle
for an interval gives its label up and its series ends (engine/metrics/peers.go,
Rebalance). The texts below are what metrics_text() returns around that
(engine/metrics/peers_review_test.go shows the same sequence from the Go
table). Multiprocess files cannot drop a series, so the mirror keeps its own
bound on peer values."""

from __future__ import annotations

import pytest

from kvferry.metrics import PrometheusMirror, _mirrored

_HEAD = ("# HELP kvferry_transfer_bytes_total Bytes of transfers we initiated that completed, by peer, op and transport.\n"
         "# TYPE kvferry_transfer_bytes_total counter\n")


def _line(engine: str, peer: str, value: int) -> str:
    return f'kvferry_transfer_bytes_total{{engine="{engine}",op="write",peer="{peer}",transport="tcp"}} {value}\n'


class _Texts:
    """A metrics_text() source that returns the texts it was given, one per call."""

    def __init__(self, *texts: str) -> None:
        self.texts = list(texts)

    def metrics_text(self) -> str:
        return self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]


def _mirrored_bytes(engine: str) -> dict:
    fam = _mirrored["kvferry_transfer_bytes"]
    out = {}
    for metric in fam.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels.get("engine") == engine:
                out[s.labels["peer"]] = s.value
    return out


def test_mirror_totals_match_the_engine_after_a_peer_label_is_given_up() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (offline?)")
    eng = "review-fold:1"
    before = _HEAD + _line(eng, "decode-7:5000", 1 << 30) + _line(eng, "other", 7)
    after = _HEAD + _line(eng, "other", 12)  # decode-7 idle: its series ended; 5 more bytes under other
    m = PrometheusMirror(_Texts(before, after), interval=3600)
    assert m.sync() and m.sync()
    mirrored = _mirrored_bytes(eng)
    assert mirrored == {"decode-7:5000": 1 << 30, "other": 12}, mirrored
    assert sum(mirrored.values()) == (1 << 30) + 12


def test_mirror_bounds_the_peer_labels_it_writes_and_loses_no_byte() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (offline?)")
    eng = "review-churn:1"
    texts = []
    for i in range(100):  # one label (MetricsPeers=1): a new peer takes it each interval
        texts.append(_HEAD + _line(eng, f"decode-{i}:5000", 1000) + _line(eng, "other", 5 * i))
    m = PrometheusMirror(_Texts(*texts), interval=3600, max_peers=4)
    for _ in texts:
        assert m.sync()
    peers = _mirrored_bytes(eng)
    assert len(peers) <= 5, f"max_peers=4, yet the mirror serves {len(peers)} peer values"
    assert sum(peers.values()) == 100 * 1000 + 5 * 99, peers
