"""MetricsScraper over real HTTP: nodes are read in parallel, merged in the endpoints' order, and a node that
does not answer makes the scrape partial, never empty."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rayscale.signals.scrape import MetricsScraper
from rayscale.signals.window import RUNNING, labels


class _Node:
    """A Prometheus endpoint that answers after ``delay_s`` and counts the requests it serves at once."""

    in_flight = 0
    most_at_once = 0
    lock = threading.Lock()

    def __init__(self, running: float, delay_s: float) -> None:
        node = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with _Node.lock:
                    _Node.in_flight += 1
                    _Node.most_at_once = max(_Node.most_at_once, _Node.in_flight)
                time.sleep(node.delay_s)
                with _Node.lock:
                    _Node.in_flight -= 1
                body = f'{RUNNING}{{model_name="m",ReplicaId="r1"}} {node.running}\n'.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.running, self.delay_s = running, delay_s
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def nodes() -> Iterator[list[_Node]]:
    # The first answers last: the merge must still take the endpoints' order, not the answers'.
    ns = [_Node(1.0, 0.4), _Node(2.0, 0.1), _Node(3.0, 0.1)]
    _Node.in_flight = _Node.most_at_once = 0
    yield ns
    for n in ns:
        n.server.shutdown()
        n.server.server_close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/metrics"  # closed again: nothing listens there


def test_nodes_are_read_at_once_and_merged_in_their_order(nodes: list[_Node]) -> None:
    dead = _dead_url()
    scraper = MetricsScraper(lambda: [n.url for n in nodes] + [dead], timeout_s=5.0)
    try:
        got = scraper.scrape(7.0)
    finally:
        scraper.close()
    assert _Node.most_at_once == 3  # every node asked before the slowest answered
    assert got.ok and got.t == 7.0
    # All three export the same series: the last endpoint's value stands, whichever answered first.
    assert got.series == {(RUNNING, labels(model_name="m", ReplicaId="r1")): 3.0}
    assert len(scraper.errors) == 1 and scraper.errors[0].startswith(dead)


def test_no_node_answering_is_a_failed_scrape_not_zero_load() -> None:
    scraper = MetricsScraper(lambda: [_dead_url(), _dead_url()], timeout_s=2.0)
    try:
        got = scraper.scrape(1.0)
    finally:
        scraper.close()
    assert not got.ok and got.series == {}
    assert len(scraper.errors) == 2
    # A period still running as the process stops: a failed scrape, not an exception in the loop.
    closed = scraper.scrape(2.0)
    assert not closed.ok and scraper.errors[0].startswith("scraper closed")
