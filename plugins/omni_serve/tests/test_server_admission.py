"""`omni serve --max-concurrent-requests N`: one request more than N in flight gets 429 with Retry-After, the
others go on, and once one ends the next is admitted."""

from __future__ import annotations

import httpx
import openai
import pytest
from click.testing import CliRunner

from omni_kernel.cli import main

from serving import BackgroundChat, running


@pytest.mark.server
def test_a_request_over_the_limit_gets_429_and_the_next_one_after_is_served(tmp_path):
    args = ["--pipeline", "steady", "--max-concurrent-requests", "1"]
    with running(args, tmp_path / "server.log", plugins=("restart_plugin:RestartPlugin",)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        words = " ".join(f"w{i}" for i in range(50))  # 1 s at 20 ms a word
        chat = BackgroundChat(client, "steady", words)
        assert chat.started(), server.output()

        with httpx.Client(base_url=server.url, timeout=10) as http:
            body = {"model": "steady", "messages": [{"role": "user", "content": "hello there"}]}
            refused = http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "too_many_requests" and "1 requests in flight" in error["message"], error
            assert refused.headers["Retry-After"] == "1"

            assert chat.join() == words  # the one in flight went on
            served = http.post("/v1/chat/completions", json=body)
            assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"] == "hello there"
            refusals = 'omni_http_requests_total{route="/v1/chat/completions",status="429"} 1.0'
            assert refusals in http.get("/metrics").text


def test_a_bad_limit_is_one_line_and_exit_2():
    result = CliRunner().invoke(main, ["serve", "--max-concurrent-requests", "-1"])
    assert result.exit_code == 2 and "-1 is not in the range x>=0" in result.output
