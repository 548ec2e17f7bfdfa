"""`omni serve --placement process`: the served pipelines' stages in worker processes (shared cores), one worker per
shared stage (ar_text and the bridge share the AR one, the three Wan pipelines the Wan one), a chat and videos
through them, workers killed between requests restarted while the server goes on (a request during the
restart gets 503 with Retry-After, and a client that retries is served), and no worker left behind once the server
has stopped."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import pytest

from omni_kernel.testing import wait_until

from serving import ServerProcess, video_done

pytestmark = [pytest.mark.server, pytest.mark.process]

ASSET = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
SMALL = {"model": "qwen_to_wan_i2v", "size": "64x96", "num_frames": "9", "num_inference_steps": "2", "seed": "3"}


def workers_of(pid: int) -> dict[int, str]:
    """The stage worker processes whose parent is `pid`: {pid: the stage named in their first log line}."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == pid and "omni_workers.worker" in cmdline:
            found[int(entry.name)] = cmdline
    return found


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-placement")
    proc = ServerProcess(["--pipeline", "ar_text", "--pipeline", "qwen_to_wan_i2v", "--pipeline", "wan_i2v",
                          "--pipeline", "wan_t2v", "--output-dir", str(tmp / "videos"),
                          "--placement", "process", "--worker-threads", "shared", "--shutdown-timeout", "5"],
                         tmp / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _chat(client) -> str:
    out = client.chat.completions.create(model="ar_text", messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=6, temperature=0)
    return out.choices[0].message.content


def test_chat_and_video_run_in_the_workers(server, client):
    workers = workers_of(server.proc.pid)
    assert len(workers) == 2, workers  # four pipelines, two models: one worker per shared stage
    assert _chat(client)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/videos", files={"input_reference": ("fox.png", ASSET.read_bytes(), "image/png")},
                      data={"prompt": "a fox", **SMALL})
        assert r.status_code == 200, r.text
        t2v = http.post("/v1/videos", data={"prompt": "a kite", **SMALL, "model": "wan_t2v"})
        assert t2v.status_code == 200, t2v.text
        for job in (video_done(http, r.json()["id"]), video_done(http, t2v.json()["id"])):
            assert job["status"] == "completed", job
            assert http.get(f"/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"
    assert "omni[video]: loading Wan2.2" in server.output()  # the worker's load line, prefixed with its stage


def test_workers_killed_while_idle_are_restarted_and_a_client_that_retries_on_503_is_served(server, client):
    expected = _chat(client)
    before = workers_of(server.proc.pid)
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: len(after := workers_of(server.proc.pid)) >= 2 and not set(after) & set(before), 60,
               f"the killed workers {sorted(before)} to be replaced", interval=0.1)
    # while the new workers load their models a request gets 503 with Retry-After, which the client honours; on a
    # loaded machine the loads may outlast its 20 retries, so the test (not the client) bounds the wait in seconds
    retrying = client.with_options(max_retries=20)

    def served() -> str | None:
        try:
            return _chat(retrying)
        except openai.InternalServerError as exc:  # 503: still loading after those retries
            assert exc.status_code == 503, exc
            return None

    assert wait_until(served, 180, "the restarted workers to serve a chat", interval=0.5) == expected
    assert "worker process died (killed by SIGKILL)" in server.output()
    assert server.proc.poll() is None


def test_stopping_the_server_leaves_no_worker(omni_cache, tmp_path):
    proc = ServerProcess(["--pipeline", "ar_text", "--placement", "process", "--worker-threads", "1",
                          "--max-restarts", "0"], tmp_path / "server.log").wait_ready()
    workers = workers_of(proc.proc.pid)
    assert len(workers) == 1
    assert proc.stop() == 0, proc.output()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 30,
               f"the workers {sorted(workers)} to be gone", interval=0.1)


def stage_metric(http, name: str, model: str, stage: str) -> float | None:
    want = f'{name}{{model="{model}",stage="{stage}"}} '
    line = next((line for line in http.get("/metrics").text.splitlines() if line.startswith(want)), None)
    return None if line is None else float(line.rsplit(" ", 1)[1])


def test_metrics_report_the_ar_workers_own_kv_blocks_and_requests(server, omni_cache):
    """The AR stage's worker sends its stage's `stats()` with its events, so /metrics reports its real KV pool and
    requests: the pool the same config builds in this process, blocks in use while a request streams (and one
    request running, none waiting), all free again once the client has gone."""
    from omni_kernel import Omni

    with Omni("ar_text") as local:
        expected = local.graph.stages["generate"].stats().kv_blocks_total
    assert expected and expected > 0
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert stage_metric(http, "omni_kv_blocks_total", "ar_text", "generate") == expected
        assert f"ar_text/generate: {expected} KV blocks" in server.output()  # logged at start-up, from the worker
        body = {"model": "ar_text", "prompt": "go on", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(6))
            wait_until(lambda: stage_metric(http, "omni_kv_blocks_used", "ar_text", "generate"), 20,
                       "the worker's stats to show the streaming request's KV blocks", interval=0.05)
            assert stage_metric(http, "omni_requests_running", "ar_text", "generate") == 1
            assert stage_metric(http, "omni_requests_waiting", "ar_text", "generate") == 0
        wait_until(lambda: not (stage_metric(http, "omni_kv_blocks_used", "ar_text", "generate")
                                or stage_metric(http, "omni_requests_running", "ar_text", "generate")), 20,
                   "the KV blocks and the request to be freed", interval=0.05)
        assert stage_metric(http, "omni_kv_blocks_total", "ar_text", "generate") == expected
