"""A real server (echo plus the fault-injecting test plugin, no model): API key, body limit, aliases, CORS,
a stage whose scheduler raises (/health 503, in-flight requests get an error, the process still answers),
schemathesis over the server's own OpenAPI schema, and graceful shutdown."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from omni_kernel.testing import wait_until

from serving import ServerProcess, fuzz, running

pytestmark = [pytest.mark.server]

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guards")
    with running(["--pipeline", "echo", "--pipeline", "fault", "--served-model-name", "parrot=echo", "--max-body-mb",
                  "0.01", "--max-text-body-mb", "0.005", "--output-dir", str(tmp / "out")], tmp / "server.log",
                 plugins=("fault_plugin:FaultPlugin",), env={"OMNI_API_KEY": KEY}) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_api_key_is_required_on_v1_routes(server, http):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open to probes
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"echo", "fault", "parrot"}


def test_alias_and_no_cors_by_default(http):
    r = http.post("/v1/completions", json={"model": "parrot", "prompt": "a b"},
                  headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a b"
    assert "access-control-allow-origin" not in r.headers


def test_body_too_large_is_413(http):
    r = http.post("/v1/completions", json={"model": "echo", "prompt": "x" * 20000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks(n: int):  # no Content-Length: counted as it arrives
        for _ in range(n):
            yield b" " * 1000

    r = http.post("/v1/videos", content=chunks(20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_text_request_has_its_own_smaller_limit(http, path):
    r = http.post(path, json={"model": "echo", "prompt": "x" * 7000, "messages": []})
    assert r.status_code == 413 and "--max-text-body-mb" in r.json()["error"]["message"], r.text
    r = http.post(path, content=(b" " * 1000 for _ in range(7)), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-text-body-mb" in r.json()["error"]["message"], r.text
    # the same size elsewhere is under --max-body-mb: read and answered on its merits
    r = http.post("/v1/videos", json={"model": "echo", "prompt": "x" * 7000})
    assert r.status_code != 413, r.text


def test_schemathesis_finds_no_server_error(server):
    checked = fuzz(server.url, {"Authorization": f"Bearer {KEY}"})
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/videos", "DELETE /v1/videos/{video_id}"} \
        <= set(checked)
    assert httpx.get(server.url + "/health").status_code == 200


def test_zz_a_stage_fault_fails_in_flight_requests_and_health_says_503(server, http):
    assert http.get("/health").status_code == 200
    body = {"model": "fault", "messages": [{"role": "user", "content": "please explode now, and then more"}],
            "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = r.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
    assert errors and errors[0]["code"] == "engine_dead" and "injected scheduler fault" in errors[0]["message"]
    assert events[-1] == "[DONE]"
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["dead_models"] == ["fault"]
    r = http.post("/v1/completions", json={"model": "fault", "prompt": "hello"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    # the process still answers, and the healthy pipeline still serves
    assert http.post("/v1/completions", json={"model": "echo", "prompt": "still up"}).json()["choices"][0]["text"] \
        == "still up"
    assert 'omni_stage_errors_total{kind="engine_dead",model="fault",stage="f"} 1.0' in http.get("/metrics").text


def test_sigterm_lets_a_streaming_request_finish_then_exits_0(omni_cache, tmp_path):
    proc = ServerProcess(["--pipeline", "echo", "--shutdown-timeout", "20"], tmp_path / "s.log").wait_ready()
    words = " ".join(f"w{i}" for i in range(30000))
    chunks: list[str] = []

    def client():
        with httpx.stream("POST", proc.url + "/v1/completions", json={"model": "echo", "prompt": words, "stream": True},
                          timeout=60) as r:
            chunks.extend(r.iter_text())

    thread = threading.Thread(target=client)
    thread.start()
    wait_until(lambda: chunks, 30, "the stream's first chunk (the request admitted and streaming)")
    assert thread.is_alive()  # SIGTERM with the stream still going
    assert proc.stop() == 0, proc.output()
    thread.join(30)
    got = {"raw": "".join(chunks)}
    assert got["raw"].endswith("data: [DONE]\n\n")
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in got["raw"].split("\n\n")
                   if e.startswith("data: {"))
    assert text == words
    assert "shutting down" in proc.output()
