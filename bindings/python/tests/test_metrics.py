"""Metrics from Python: Engine.metrics_text() in the Prometheus text format,
and register_prometheus, which adds an engine's series to what a host
process (SGLang, vLLM) already serves with prometheus_client."""

from __future__ import annotations

import pytest

import kvferry


def _families(text: str) -> dict:
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed (offline?)")
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _sample(families: dict, family: str, sample: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {sample}{labels} in {[(s.name, s.labels) for s in families[family].samples]}")


def test_metrics_text_counts_what_the_engine_moved() -> None:
    with kvferry.Engine() as owner, kvferry.Engine() as init:
        dst = owner.alloc_buffer(1 << 20)
        src = init.alloc_buffer(1 << 20)
        seg = init.open_segment(owner.name)
        for _ in range(3):
            init.write(seg, int(src), int(dst), 1 << 20)
        fams = _families(init.metrics_text())
        assert _sample(fams, "kvferry_transfer_bytes", "kvferry_transfer_bytes_total",
                       engine=init.name, peer=owner.name, op="write") == 3 << 20
        assert _sample(fams, "kvferry_transfers", "kvferry_transfers_total",
                       peer=owner.name, op="write", status="completed") == 3
        assert _sample(fams, "kvferry_transfer_duration_seconds", "kvferry_transfer_duration_seconds_count",
                       op="write", size="le_1MiB") == 3
        assert _sample(fams, "kvferry_info", "kvferry_info", version=kvferry.__version__) == 1
        # The engines pick shm or tcp (same host); the owner counts the
        # bytes under whichever carried them.
        owner_fams = _families(owner.metrics_text())
        assert sum(s.value for s in owner_fams["kvferry_owner_bytes"].samples
                   if s.labels.get("direction") == "in") == 3 << 20


def test_register_prometheus_adds_the_engine_to_a_host_registry_and_survives_its_close() -> None:
    prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (offline?)")
    registry = prometheus_client.CollectorRegistry()
    host_counter = prometheus_client.Counter("host_requests", "the host's own metric", registry=registry)
    host_counter.inc()
    e = kvferry.Engine()
    kvferry.register_prometheus(e, registry)
    text = prometheus_client.generate_latest(registry).decode()
    fams = _families(text)
    assert _sample(fams, "host_requests", "host_requests_total") == 1
    assert _sample(fams, "kvferry_info", "kvferry_info", engine=e.name) == 1
    e.close()
    text = prometheus_client.generate_latest(registry).decode()
    assert "host_requests_total 1.0" in text
    assert "kvferry_info" not in text


def test_register_prometheus_refuses_what_has_no_metrics() -> None:
    with pytest.raises(TypeError, match="metrics_text"):
        kvferry.PrometheusCollector(object())


def test_the_mooncake_shim_gives_its_metrics_text() -> None:
    from kvferry.mooncake import TransferEngine
    t = TransferEngine()
    assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        text = t.metrics_text()
        assert f'engine="{t.get_session_id()}"' in text
        assert "# TYPE kvferry_transfer_retries_total counter" in text
    finally:
        t.close()
    with pytest.raises(RuntimeError):
        t.metrics_text()


def test_in_multiprocess_mode_a_worker_mirrors_its_engine_into_the_serving_process(tmp_path) -> None:
    """SGLang's and vLLM's way: the engine lives in a worker process while
    another process serves /metrics from prometheus_client's multiprocess
    files. The worker's register_prometheus mirrors kvferry's series into
    those files; the serving process's MultiProcessCollector finds them."""
    prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (offline?)")
    from prometheus_client import multiprocess
    import subprocess
    import sys
    import os
    from pathlib import Path
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(Path(kvferry.__file__).parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    worker = """
import kvferry
with kvferry.Engine() as owner, kvferry.Engine() as init:
    dst = owner.alloc_buffer(1 << 20)
    src = init.alloc_buffer(1 << 20)
    seg = init.open_segment(owner.name)
    m = kvferry.register_prometheus(init, interval=3600)
    assert isinstance(m, kvferry.PrometheusMirror), m
    init.write(seg, int(src), int(dst), 1 << 20)
    init.write(seg, int(src), int(dst), 1 << 20)
    assert m.sync()
    init.write(seg, int(src), int(dst), 1 << 20)
    assert m.sync()  # a second sync adds only the increase

    def segments_open():
        import os, prometheus_client
        from prometheus_client import multiprocess
        r = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(r, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
        return r.get_sample_value("kvferry_segments_open", {"engine": init.name})

    assert segments_open() == 1, segments_open()  # a gauge, while this worker lives
    m.stop()
    assert segments_open() == 0, segments_open()  # a stopped mirror's gauges read 0
    print(init.name, owner.name)
"""
    p = subprocess.run([sys.executable, "-c", worker], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    init_name, owner_name = p.stdout.split()

    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    fams = _families(prometheus_client.generate_latest(registry).decode())
    assert _sample(fams, "kvferry_transfer_bytes", "kvferry_transfer_bytes_total",
                   engine=init_name, peer=owner_name, op="write") == 3 << 20
    assert _sample(fams, "kvferry_transfers", "kvferry_transfers_total",
                   engine=init_name, status="completed") == 3
    assert _sample(fams, "kvferry_transfer_duration_seconds", "kvferry_transfer_duration_seconds_count",
                   engine=init_name, op="write", size="le_1MiB") == 3
    assert _sample(fams, "kvferry_transfer_duration_seconds", "kvferry_transfer_duration_seconds_bucket",
                   engine=init_name, op="write", size="le_1MiB", le="+Inf") == 3
    # The mirror was stopped: the engine's gauges read 0, not what it
    # last held.
    assert _sample(fams, "kvferry_segments_open", "kvferry_segments_open", engine=init_name) == 0


def test_an_engine_serves_its_metrics_at_metrics_addr() -> None:
    import urllib.request
    with kvferry.Engine(metrics_addr="127.0.0.1:0", ignore_env=True) as e:
        addr = e.metrics_addr
        assert addr.startswith("127.0.0.1:") and addr != "127.0.0.1:0"
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert f'kvferry_info{{engine="{e.name}",version="{kvferry.__version__}"}} 1' in text
    with kvferry.Engine(ignore_env=True) as e:
        assert e.metrics_addr == ""
