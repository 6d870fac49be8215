"""kvferry's metrics in a process that already serves ``/metrics``.

SGLang and vLLM expose their metrics with ``prometheus_client``. One call
where the transfer engine is made adds kvferry's series to that endpoint::

    import kvferry
    kvferry.register_prometheus(engine)   # a kvferry.Engine, or the
                                          # Mooncake-compatible TransferEngine

Two cases, told apart by ``PROMETHEUS_MULTIPROC_DIR``:

- **Multiprocess mode** (the variable is set: SGLang sets it with
  ``--enable-metrics``; vLLM honours it). The engine lives in a worker
  process (SGLang's scheduler, vLLM's GPU worker) while another process
  serves ``/metrics`` from the files workers write. A collector in the worker
  would never be asked, so kvferry's series are mirrored into
  ``prometheus_client`` metrics of that mode, by a daemon thread, every
  ``interval`` seconds (counters and histograms by their increase, gauges by
  their value, summed over live processes).
- **Otherwise** the engine's metrics join ``registry`` (``prometheus_client``'s
  ``REGISTRY`` by default) as a collector, read at each scrape.

``prometheus_client`` is imported only when this is called: kvferry does not
depend on it.
"""

import logging
import os
import threading
from typing import Any, Dict, Optional, Tuple

__all__ = ["register_prometheus", "PrometheusCollector", "PrometheusMirror"]

_log = logging.getLogger("kvferry")


def _check_source(source: Any) -> None:
    if not callable(getattr(source, "metrics_text", None)):
        raise TypeError(f"{type(source).__name__} has no metrics_text(): pass a kvferry Engine "
                        "or a kvferry.mooncake.TransferEngine")


def _multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))


class PrometheusCollector:
    """A ``prometheus_client`` collector of one engine's metrics.

    ``source`` is anything with a ``metrics_text()`` method returning the
    Prometheus text format: a :class:`kvferry.Engine`, or
    :class:`kvferry.mooncake.TransferEngine`. A scrape after the engine was
    closed yields nothing rather than failing the host's whole ``/metrics``.
    """

    def __init__(self, source: Any) -> None:
        _check_source(source)
        self._source = source

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families
        try:
            text = self._source.metrics_text()
        except Exception:  # a closed engine: its series are gone
            return
        yield from text_string_to_metric_families(text)

    def describe(self):
        # Unchecked, as kvferry's own registry: the series (peers, NICs)
        # come and go, so registering must not scrape the engine.
        return []


# The multiprocess-mode metrics of this process, by family name: engines of
# one process mirror into the same ones (their series differ by the engine
# label), and prometheus_client wants one object per name.
_mirrored: Dict[str, Any] = {}
_mirrored_lock = threading.Lock()


class PrometheusMirror:
    """Copies one engine's metrics into ``prometheus_client``'s multiprocess
    files, every ``interval`` seconds on a daemon thread, until the engine is
    closed or :meth:`stop` is called. :meth:`sync` copies once, now.

    A series in those files cannot be taken out again, while the engine's
    per-peer series come and go (a peer idle for 30 s gives its label up to
    a busier one). So the mirror keeps at most ``max_peers`` peer label
    values per engine: the series of a peer that left stays at its last
    value, and peers past the bound are counted under ``peer="other"``.
    Totals stay right: each engine series adds only its own increase."""

    def __init__(self, source: Any, interval: float = 5.0, *, max_peers: int = 64) -> None:
        _check_source(source)
        if not interval > 0:
            raise ValueError(f"interval {interval!r}: want a positive number of seconds")
        if max_peers < 1:
            raise ValueError(f"max_peers {max_peers!r}: want at least 1")
        self._source = source
        self._interval = float(interval)
        self._max_peers = int(max_peers)
        self._peers: Dict[Tuple, set] = {}  # peer label values mirrored, by family and engine
        self._last: Dict[Tuple, float] = {}  # counters' and histograms' values at the last sync
        self._gauges: Dict[Tuple, Any] = {}  # gauge children set, zeroed at stop
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._warned: set = set()

    def start(self) -> "PrometheusMirror":
        self.sync()
        self._thread = threading.Thread(target=self._run, name="kvferry-metrics-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread; the engine's gauges go to 0 (its counters stay,
        as a counter of a process that is gone would)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        with self._lock:
            for child in self._gauges.values():
                child.set(0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self.sync():
                with self._lock:
                    for child in self._gauges.values():
                        child.set(0)
                return

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning("kvferry metrics mirror: %s", msg)

    def sync(self) -> bool:
        """Copies the engine's metrics once; False when the engine is closed."""
        from prometheus_client.parser import text_string_to_metric_families
        try:
            text = self._source.metrics_text()
        except Exception:
            return False
        with self._lock:
            self._seen: set = set()
            for fam in text_string_to_metric_families(text):
                try:
                    if fam.type == "counter":
                        self._counter(fam)
                    elif fam.type == "gauge":
                        self._gauge(fam)
                    elif fam.type == "histogram":
                        self._histogram(fam)
                except ValueError as e:  # a label set the family's first did not have
                    self._warn_once(fam.name, f"{fam.name}: {e}")
            # Series the engine no longer shows: forgotten, so that memory
            # stays bounded; one that comes back starts from its new value.
            for k in [k for k in self._last if k not in self._seen]:
                del self._last[k]
        return True

    def _bounded(self, family: str, labels: Dict[str, str]) -> Dict[str, str]:
        """labels, with a peer past max_peers of its engine counted as other."""
        peer = labels.get("peer")
        if peer is None or peer == "other":
            return labels
        seen = self._peers.setdefault((family, labels.get("engine")), set())
        if peer in seen:
            return labels
        if len(seen) < self._max_peers:
            seen.add(peer)
            return labels
        return {**labels, "peer": "other"}

    def _metric(self, cls: Any, fam: Any, labelnames: Tuple[str, ...], **kw: Any) -> Any:
        with _mirrored_lock:
            m = _mirrored.get(fam.name)
            if m is None:
                # Not registered with any registry: in multiprocess mode
                # the values go to this process's files, which the serving
                # process reads; registering would clash with a second
                # engine of this process mirroring the same family.
                m = cls(fam.name, fam.documentation or fam.name, labelnames, registry=None, **kw)
                _mirrored[fam.name] = m
        if tuple(m._labelnames) != labelnames:
            raise ValueError(f"labels {labelnames}, the family has {tuple(m._labelnames)}")
        return m

    def _counter(self, fam: Any) -> None:
        from prometheus_client import Counter
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue  # _created
            names = tuple(sorted(s.labels))
            m = self._metric(Counter, fam, names)
            key = (s.name, tuple(sorted(s.labels.items())))
            self._seen.add(key)
            d = s.value - self._last.get(key, 0.0)
            if d < 0:  # the engine's counter started again
                d = s.value
            if d > 0:
                m.labels(**self._bounded(fam.name, s.labels)).inc(d)
            self._last[key] = s.value

    def _gauge(self, fam: Any) -> None:
        from prometheus_client import Gauge
        for s in fam.samples:
            names = tuple(sorted(s.labels))
            m = self._metric(Gauge, fam, names, multiprocess_mode="livesum")
            child = m.labels(**s.labels)
            child.set(s.value)
            self._gauges[(s.name, tuple(sorted(s.labels.items())))] = child

    def _histogram(self, fam: Any) -> None:
        from prometheus_client import Histogram
        series: Dict[Tuple, Dict[str, Any]] = {}
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            key = tuple(sorted(labels.items()))
            h = series.setdefault(key, {"labels": labels, "buckets": [], "sum": 0.0})
            if s.name.endswith("_bucket"):
                h["buckets"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
        for key, h in series.items():
            bounds = sorted(h["buckets"])
            finite = [b for b, _ in bounds if b != float("inf")]
            names = tuple(sorted(h["labels"]))
            m = self._metric(Histogram, fam, names, buckets=finite)
            child = m.labels(**h["labels"])
            cells = getattr(child, "_buckets", None)
            total = getattr(child, "_sum", None)
            if cells is None or total is None or len(cells) != len(bounds):
                self._warn_once(fam.name, f"{fam.name}: this prometheus_client keeps histograms in a way "
                                          "kvferry does not know; the histogram is not mirrored")
                return
            prev_cum = 0.0
            for i, (le, cum) in enumerate(bounds):
                k = (fam.name, key, le)
                self._seen.add(k)
                d = (cum - prev_cum) - self._last.get(k, 0.0)
                self._last[k] = cum - prev_cum
                prev_cum = cum
                if d > 0:
                    cells[i].inc(d)
            k = (fam.name, key, "sum")
            self._seen.add(k)
            d = h["sum"] - self._last.get(k, 0.0)
            self._last[k] = h["sum"]
            if d > 0:
                total.inc(d)


def register_prometheus(source: Any, registry: Optional[Any] = None, *, interval: float = 5.0,
                        max_peers: int = 64) -> Any:
    """Adds ``source``'s metrics to what the host process serves at
    ``/metrics``. In ``prometheus_client``'s multiprocess mode (with no
    ``registry`` given) it starts and returns a :class:`PrometheusMirror`;
    otherwise it registers a :class:`PrometheusCollector` with ``registry``
    (``prometheus_client.REGISTRY`` when None) and returns it, for
    ``registry.unregister(collector)`` when the engine is closed."""
    if registry is None and _multiprocess_mode():
        return PrometheusMirror(source, interval, max_peers=max_peers).start()
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811
    collector = PrometheusCollector(source)
    registry.register(collector)
    return collector
