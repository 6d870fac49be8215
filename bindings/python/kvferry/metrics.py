"""kvferry's metrics in a process that already serves ``/metrics``.

SGLang and vLLM expose their metrics with ``prometheus_client``. Registering
an engine here adds kvferry's series to what that process serves, with no
second port::

    import kvferry
    kvferry.register_prometheus(engine)   # a kvferry.Engine, or the
                                          # Mooncake-compatible TransferEngine

Each scrape reads the engine's metrics text (``Engine.metrics_text()``) and
hands its families to ``prometheus_client``. ``prometheus_client`` is
imported only when this is called: kvferry does not depend on it.
"""

from typing import Any, Optional

__all__ = ["register_prometheus", "PrometheusCollector"]


class PrometheusCollector:
    """A ``prometheus_client`` collector of one engine's metrics.

    ``source`` is anything with a ``metrics_text()`` method returning the
    Prometheus text format: a :class:`kvferry.Engine`, or
    :class:`kvferry.mooncake.TransferEngine`. A scrape after the engine was
    closed yields nothing rather than failing the host's whole ``/metrics``.
    """

    def __init__(self, source: Any) -> None:
        if not callable(getattr(source, "metrics_text", None)):
            raise TypeError(f"{type(source).__name__} has no metrics_text(): pass a kvferry Engine "
                            "or a kvferry.mooncake.TransferEngine")
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


def register_prometheus(source: Any, registry: Optional[Any] = None) -> PrometheusCollector:
    """Adds ``source``'s metrics to ``registry`` (``prometheus_client``'s
    default ``REGISTRY`` when None), which the host process already serves
    at ``/metrics``. Returns the collector, for
    ``registry.unregister(collector)`` when the engine is closed."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811
    collector = PrometheusCollector(source)
    registry.register(collector)
    return collector
