"""Review tests of PrometheusMirror: what it writes must add up to what the
engine reports, while the engine's peer labels come and go.

The engine gives at most MetricsPeers peers a label of their own; a peer idle
for an interval gives its label up and its counts are folded into
peer="other" (engine/metrics/peers.go, Rebalance). The texts below are what
metrics_text() returns around such a fold (engine/metrics/peers_review_test.go
shows the same sequence from the Go table)."""

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


def test_mirror_totals_match_the_engine_after_a_peer_label_is_folded_into_other() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (offline?)")
    eng = "review-fold:1"
    before = _HEAD + _line(eng, "decode-7:5000", 1 << 30) + _line(eng, "other", 7)
    after = _HEAD + _line(eng, "other", (1 << 30) + 7)  # decode-7 idle: retired, folded
    m = PrometheusMirror(_Texts(before, after), interval=3600)
    assert m.sync() and m.sync()
    mirrored = _mirrored_bytes(eng)
    assert sum(mirrored.values()) == (1 << 30) + 7, (
        f"the engine moved {(1 << 30) + 7} bytes in all; the mirror now says {sum(mirrored.values())}: {mirrored}")


def test_mirror_keeps_the_engines_bound_on_peer_labels() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (offline?)")
    eng = "review-churn:1"
    texts = []
    total = 0
    for i in range(100):  # one label (MetricsPeers=1): a new peer takes it each interval
        texts.append(_HEAD + _line(eng, f"decode-{i}:5000", 1000) + _line(eng, "other", total))
        total += 1000
    m = PrometheusMirror(_Texts(*texts), interval=3600)
    for _ in texts:
        assert m.sync()
    peers = _mirrored_bytes(eng)
    assert len(peers) <= 2, f"the engine never showed more than 2 peer values; the mirror serves {len(peers)}"
