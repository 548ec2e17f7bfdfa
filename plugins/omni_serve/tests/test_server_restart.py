"""A stage worker restarting under `omni serve --placement process` (the restart_plugin's pipelines, no model):
the engine thread never waits for the new worker's model load, so another pipeline's stream goes on, a request
that needs the restarting stage gets 503 (kind unavailable, Retry-After) at once, and once the worker is ready
that pipeline is served again."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest

from omni_kernel.testing import wait_until

from serving import BackgroundChat, running

pytestmark = [pytest.mark.server, pytest.mark.process]


def test_a_restarting_worker_stalls_no_other_pipeline_and_its_own_answers_503(tmp_path):
    gate = tmp_path / "gate"
    args = ["--pipeline", "steady", "--pipeline", "flaky", "--placement", "process", "-c", f"flaky_gate={gate}"]
    with running(args, tmp_path / "server.log", plugins=("restart_plugin:RestartPlugin",)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        words = " ".join(f"w{i}" for i in range(150))  # 3 s at 20 ms a word
        chat = BackgroundChat(client, "steady", words)
        assert chat.started(), server.output()

        (flaky,) = re.findall(r"omni\[flaky\]: loading flaky \(pid (\d+)\)", server.output())
        gate.touch()
        os.kill(int(flaky), signal.SIGKILL)
        wait_until(lambda: "stage 'flaky': its worker process died" in server.output(), 30,
                   "the idle watch to notice the killed worker")

        with httpx.Client(base_url=server.url, timeout=10) as http:
            body = {"model": "flaky", "messages": [{"role": "user", "content": "hello there"}]}
            refused = http.post("/v1/chat/completions", json=body)  # a hang here: the engine thread waits
            answered = time.monotonic()
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "unavailable" and "stage 'flaky'" in error["message"], error
            assert "restarting" in error["message"] and int(refused.headers["Retry-After"]) >= 1
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["restarting"] == ["flaky/flaky"], health.text  # not dead
            metrics = http.get("/metrics").text
            assert 'omni_stage_restarts_total{model="flaky",stage="flaky"} 1.0' in metrics
            assert 'omni_stage_restarting{model="flaky",stage="flaky"} 1.0' in metrics
            assert 'omni_stage_restarts_total{model="steady",stage="steady"} 0.0' in metrics

            assert chat.join() == words
            assert chat.times[-1] > answered  # the stream went on while the flaky worker was loading
            assert len(re.findall(r"omni\[flaky\]: loading", server.output())) == 1  # still loading

            gate.unlink()

            def served():
                reply = http.post("/v1/chat/completions", json=body)
                return reply if reply.status_code != 503 else None

            r = wait_until(served, 60, "the restarted flaky worker to serve", interval=0.05)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello there", r.text
            assert http.get("/health").json()["restarting"] == []
            assert 'omni_stage_restarting{model="flaky",stage="flaky"} 0.0' in http.get("/metrics").text
