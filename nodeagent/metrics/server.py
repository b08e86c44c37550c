"""Serve the metrics over HTTP, from a background thread, at `agent.metrics.listen`.

The endpoint answers every path (Prometheus scrapes /metrics) with the text format, or
OpenMetrics when asked. It is plain HTTP without authentication: bind it to loopback, or
to an address only the scraper can reach.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from nodeagent.errors import NodeagentError
from nodeagent.metrics.collector import TickCollector
from nodeagent.spec.listen import parse_listen


class MetricsServer:
    def __init__(
        self, listen: str, collector: TickCollector, server: WSGIServer, thread: threading.Thread
    ) -> None:
        self.listen = listen
        self.collector = collector
        self._server = server
        self._thread = thread

    @classmethod
    def start(cls, listen: str, collector: TickCollector) -> MetricsServer:
        """Bind and serve; a port in use or an address this host lacks is a one-line error."""
        host, port = parse_listen(listen)
        registry = CollectorRegistry()
        registry.register(collector)
        ProcessCollector(registry=registry)  # the agent's own CPU, memory and open files
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            why = e.strerror or str(e)
            raise NodeagentError(f"agent.metrics.listen {listen}: cannot listen: {why}") from None
        return cls(listen, collector, server, thread)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
