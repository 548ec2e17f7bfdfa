"""One real `omni serve` process (ar_text, wan_i2v and echo on the demo checkpoints) driven by the official
openai client (sync and async) and by httpx for SSE framing and error cases."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from omni_kernel.testing import wait_until

from serving import ServerProcess, fuzz

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

ASSET = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": [{"type": "text", "text": "Another"},
                                                                                  {"type": "text", "text": "?"}]}]


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    proc = ServerProcess(["--pipeline", "ar_text", "--pipeline", "wan_i2v", "--pipeline", "echo", "--output-dir",
                          str(tmp / "videos"), "--shutdown-timeout", "5"], tmp / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        code = proc.stop()
        log = proc.output()
        assert code == 0, log
        assert not list((tmp / "videos").glob("*.tmp*")), "no partial files left"
        assert not (tmp / "videos" / ".uploads").exists()


@pytest.fixture(scope="module")
def tokenizer(server, omni_cache):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_cache / "demo" / "qwen2-tiny")


def metric(http, name: str, default: float | None = None, **labels) -> float:
    """The value of one sample in /metrics (a sample that is not there yet: `default`, else a failure)."""
    text = http.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")) or (
                want and line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_startup_logs_the_kv_pool_and_models_are_listed(server, client):
    assert re.search(r"ar_text/generate: \d+ KV blocks", server.output())
    ids = {m.id for m in client.models.list().data}
    assert ids == {"ar_text", "wan_i2v", "echo"}


def test_chat_multi_turn_uses_the_chat_template(client, tokenizer):
    out = client.chat.completions.create(model="ar_text", messages=CHAT, max_tokens=8, temperature=0)
    expected = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "Another?"} for m in CHAT],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.usage.prompt_tokens == len(expected)
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == len(expected) + 8
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.model == "ar_text"


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    kwargs = dict(model="ar_text", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stop_string_ends_with_finish_reason_stop(client):
    kwargs = dict(model="ar_text", prompt="stop here", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the demo model's output has no usable stop string here")
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_penalties_and_min_p_are_taken_and_applied_on_both_routes(http, client):
    """`vllm bench serve`'s body (repetition_penalty 1.0 in every request, streamed, logprobs null) completes and
    gives the text of the same request without it; a penalty changes greedy text, on completions and chats (the
    demo model rarely repeats a token, so the penalties here reward repeating)."""
    prompt, messages = "tell me a story", [{"role": "user", "content": "tell me a story"}]
    bench = {"model": "ar_text", "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 16, "logprobs": None,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=bench) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 16
    kwargs = dict(model="ar_text", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    assert streamed == plain
    penalized = client.completions.create(frequency_penalty=-2.0, **kwargs).choices[0].text
    assert penalized != plain
    repeated = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "repetition_penalty": 0.3}})
    assert repeated.choices[0].text != plain
    chat = dict(model="ar_text", messages=messages, max_tokens=16, temperature=0)
    plain_chat = client.chat.completions.create(**chat).choices[0].message.content
    assert client.chat.completions.create(presence_penalty=-2.0, **chat).choices[0].message.content != plain_chat
    sampled = client.chat.completions.create(**{**chat, "temperature": 0.8}, seed=3, presence_penalty=0.5,
                                             frequency_penalty=-0.5, extra_body={"min_p": 0.1})
    assert sampled.choices[0].finish_reason in ("length", "stop")


def test_async_client_chat_and_completions(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "a b c"}])
        comp = await client.completions.create(model="echo", prompt="x y z", max_tokens=2)
        stream = await client.completions.create(model="echo", prompt="p q r", stream=True)
        text = "".join([c.choices[0].text async for c in stream])
        await client.close()
        return chat, comp, text

    chat, comp, text = asyncio.run(main())
    assert chat.choices[0].message.content == "a b c" and chat.choices[0].finish_reason == "stop"
    assert comp.choices[0].text == "x y" and comp.choices[0].finish_reason == "length"
    assert text == "p q r"


def test_sse_framing(http):
    body = {"model": "echo", "messages": [{"role": "user", "content": "one two"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"]) == "one two"
    assert payloads[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert len({p["id"] for p in payloads}) == 1


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "stop"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": "lots"}, 400,
     "frequency_penalty"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, 400, "min_p"),
    ({"model": "ar_text", "messages": [{"role": "user", "content": "x"}], "output": "/etc/x.mp4"}, 400, "output"),
    ({"model": "ar_text", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "ar_text", "messages": []}, 400, "messages"),
    ({"model": "wan_i2v", "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
])
def test_bad_requests_are_openai_errors_naming_the_field(http, body, status, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    if status == 404:
        assert "ar_text" in error["message"] and "echo" in error["message"]


def test_prompt_over_the_context_window_says_both_numbers(http):
    r = http.post("/v1/completions", json={"model": "ar_text", "prompt": "word " * 3000})
    assert r.status_code == 400
    numbers = re.findall(r"\d+", r.json()["error"]["message"])
    assert "512" in numbers and any(int(n) > 512 for n in numbers)


def test_unknown_route_and_malformed_json(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def _solo_and_concurrent(server, prompts, max_tokens):
    async def one(client, prompt):
        stream = await client.chat.completions.create(model="ar_text", messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        solo = [await one(client, p) for p in prompts]
        together = await asyncio.gather(*[one(client, p) for p in prompts])
        await client.close()
        return solo, together

    return asyncio.run(main())


def test_32_concurrent_streaming_clients_each_equal_their_solo_greedy_output(server, http):
    prompts = [f"request {i}: " + "tell me something " * (i % 5) for i in range(32)]
    solo, together = _solo_and_concurrent(server, prompts, 16)
    assert together == solo
    assert all(solo)
    assert metric(http, "omni_time_to_first_token_seconds_count", model="ar_text") >= 64


def test_client_disconnect_aborts_and_frees_kv_blocks(server, http):
    aborted = metric(http, "omni_requests_aborted_total")
    body = {"model": "ar_text", "prompt": "go on", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert metric(http, "omni_kv_blocks_used", model="ar_text", stage="generate") > 0
    wait_until(lambda: metric(http, "omni_kv_blocks_used", model="ar_text", stage="generate") == 0
               and metric(http, "omni_requests_aborted_total") > aborted, 20,
               "the disconnected stream's abort and its KV blocks freed", interval=0.05)
    assert metric(http, "omni_requests_running", model="ar_text", stage="generate") == 0
    assert metric(http, "omni_requests_aborted_total") == aborted + 1


def test_non_streaming_disconnect_aborts_too(server, http):
    aborted = metric(http, "omni_requests_aborted_total")
    body = {"model": "ar_text", "prompt": "go on", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_until(lambda: metric(http, "omni_requests_aborted_total") > aborted, 20, "the disconnected request's abort",
               interval=0.05)
    assert metric(http, "omni_requests_aborted_total") == aborted + 1
    assert metric(http, "omni_kv_blocks_used", model="ar_text", stage="generate") == 0


def _decode(path: Path) -> tuple[int, tuple[int, int]]:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = reader.__next__()
    return sum(1 for _ in reader), tuple(meta["size"])


def test_video_create_poll_download_delete(client, http, tmp_path):
    steps_before = metric(http, "omni_denoise_step_seconds_count", 0.0, model="wan_i2v")
    with open(ASSET, "rb") as image:
        job = client.videos.create(model="wan_i2v", prompt="a lighthouse at dusk", input_reference=image, size="64x96",
                                   extra_body={"num_frames": 9, "num_inference_steps": 3, "seed": 1})
    assert job.status in ("queued", "in_progress") and job.object == "video"
    done = client.videos.poll(job.id, poll_interval_ms=50)
    assert done.status == "completed" and done.progress == 100 and done.size == "64x96"
    assert done.completed_at >= done.created_at
    out = tmp_path / "v.mp4"
    client.videos.download_content(job.id).write_to_file(out)
    assert _decode(out) == (9, (64, 96))
    assert metric(http, "omni_denoise_step_seconds_count", model="wan_i2v") >= steps_before + 2
    assert job.id in [v.id for v in client.videos.list(order="asc")]
    assert client.videos.delete(job.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)


def test_video_content_is_404_while_in_progress_and_delete_cancels(http, server):
    with open(ASSET, "rb") as image:
        r = http.post("/v1/videos", files={"input_reference": ("i.png", image, "image/png")},
                      data={"prompt": "slow", "model": "wan_i2v", "size": "64x64", "num_frames": "9",
                            "num_inference_steps": "200"})
    assert r.status_code == 200, r.text
    vid = r.json()["id"]
    job = wait_until(lambda: (job := http.get(f"/v1/videos/{vid}").json())["progress"] > 0 and job, 30,
                     "the video's first denoise step", interval=0.02)
    assert job["status"] == "in_progress" and 0 < job["progress"] < 100
    assert http.get(f"/v1/videos/{vid}/content").status_code == 404
    assert http.delete(f"/v1/videos/{vid}").json()["deleted"] is True
    assert http.get(f"/v1/videos/{vid}").status_code == 404
    wait_until(lambda: metric(http, "omni_requests_running", model="wan_i2v", stage="wan") == 0, 10,
               "the deleted video's request to leave the stage", interval=0.02)


@pytest.mark.parametrize("fields, param", [({"size": "65x64"}, "width"), ({"size": "big"}, "size"),
                                           ({"num_frames": "10"}, "num_frames"), ({"seconds": "-1"}, "seconds"),
                                           ({"preset": "nope"}, "preset"), ({"model": "ar_text"}, "model"),
                                           ({"num_inference_steps": "201"}, "num_inference_steps")])
def test_bad_video_requests(http, fields, param):
    with open(ASSET, "rb") as image:
        r = http.post("/v1/videos", files={"input_reference": ("i.png", image, "image/png")},
                      data={"prompt": "p", "model": "wan_i2v", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_video_without_an_image_and_with_a_non_image(http):
    r = http.post("/v1/videos", data={"prompt": "p", "model": "wan_i2v"})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    r = http.post("/v1/videos", files={"input_reference": ("i.png", b"not an image", "image/png")},
                  data={"prompt": "p", "model": "wan_i2v"})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    r = http.post("/v1/videos", data={"prompt": "p", "model": "wan_i2v", "input_reference": "http://example.com/a.png"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


def test_video_fields_are_the_options_wan_declares_and_seconds_become_frames(client, http, tmp_path):
    for fields, param in (({"steps": "2"}, "steps"), ({"num_inference_steps": "two"}, "num_inference_steps"),
                          ({"output": "/tmp/x.mp4"}, "output")):
        with open(ASSET, "rb") as image:
            r = http.post("/v1/videos", files={"input_reference": ("i.png", image, "image/png")},
                          data={"prompt": "p", "model": "wan_i2v", **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "valid fields: " in (message := http.post("/v1/videos", data={"prompt": "p", "steps": "2"}).text)
    assert "num_inference_steps" in message and "input_reference" in message and "output" not in message
    with open(ASSET, "rb") as image:
        job = client.videos.create(model="wan_i2v", prompt="a short one", input_reference=image, size="64x64",
                                   seconds="0.5", extra_body={"num_inference_steps": 1})
    done = client.videos.poll(job.id, poll_interval_ms=50)
    assert done.status == "completed" and done.seconds == "0.5", done
    client.videos.download_content(job.id).write_to_file(out := tmp_path / "short.mp4")
    assert _decode(out) == (13, (64, 64))  # 0.5 s at the model's 24 fps, as 4k+1 frames
    client.videos.delete(job.id)


def test_access_log_has_one_line_per_request(server, http):
    r = http.get("/v1/models")
    rid = r.headers["x-request-id"]
    lines = wait_until(lambda: [line for line in server.output().splitlines() if rid in line], 10,
                       f"the access log line of {rid}")  # written once the response is sent
    assert http.get("/health").status_code == 200  # a later request's line follows it: nothing more for rid
    lines = [line for line in server.output().splitlines() if rid in line]
    assert len(lines) == 1 and "GET /v1/models 200" in lines[0]


def test_health_and_metrics(http):
    """/health says ok; /metrics counts exactly what was served and reads 0 in flight once the engine is idle."""
    assert http.get("/health").json()["status"] == "ok"
    served = {"route": "/v1/completions", "status": "200"}
    counted = ("omni_http_requests_total", served), ("omni_generated_tokens_total", {"model": "echo"}), \
        ("omni_prompt_tokens_total", {"model": "echo"}), \
        ("omni_e2e_request_latency_seconds_count", {"model": "echo", "route": "completions"})
    before = [metric(http, name, 0.0, **labels) for name, labels in counted]
    usages = [http.post("/v1/completions", json={"model": "echo", "prompt": f"count {i} words"}).json()["usage"]
              for i in range(3)]
    want = [3, sum(u["completion_tokens"] for u in usages), sum(u["prompt_tokens"] for u in usages), 3]
    assert want[1] == 9 and want[2] == 9  # echo: three words in, the same three out
    # the HTTP counter is bumped once a response has been sent, so it may trail the client by a moment
    wait_until(lambda: metric(http, "omni_http_requests_total", 0.0, **served) >= before[0] + 3, 10,
               "3 more served requests")
    assert [metric(http, name, 0.0, **labels) - b for (name, labels), b in zip(counted, before)] == want

    wait_until(lambda: metric(http, "omni_requests_in_flight") == 0, 30, "the engine to be idle")
    for pipeline, stage in (("ar_text", "generate"), ("wan_i2v", "wan"), ("echo", "echo")):
        assert metric(http, "omni_requests_running", model=pipeline, stage=stage) == 0
        assert metric(http, "omni_requests_waiting", model=pipeline, stage=stage) == 0
    assert metric(http, "omni_kv_blocks_used", model="ar_text", stage="generate") == 0
    assert metric(http, "omni_kv_blocks_total", model="ar_text", stage="generate") > 0
    assert metric(http, "omni_engine_alive") == 1
    text = http.get("/metrics").text
    for name in ("omni_prefix_cache_hit_tokens", "omni_time_to_first_token_seconds", "omni_inter_token_latency_seconds",
                 "omni_video_jobs", "omni_denoise_step_seconds", "omni_stage_errors"):
        assert name in text, name


def test_schemathesis_on_the_model_pipelines_finds_no_server_error(server, http):
    limit = {"model": "ar_text", "max_tokens": 4, "max_completion_tokens": 4}
    checked = fuzz(server.url, bodies={"/v1/chat/completions": limit, "/v1/completions": limit})
    assert "POST /v1/chat/completions" in checked
    assert http.get("/health").status_code == 200
