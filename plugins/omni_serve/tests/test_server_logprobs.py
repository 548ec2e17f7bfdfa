"""Logprobs over HTTP: a real `omni serve` (ar_text on the demo checkpoint, fp32) against torch.log_softmax of HF's
own forward on the same ids, within 1e-4: chat `logprobs`/`top_logprobs` through the official openai client,
completions `logprobs`/`echo` (lm-eval's loglikelihood request among them), streamed and not, several prompts
in one batch; and the 400s naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from serving import ServerProcess

pytestmark = [pytest.mark.server]

TOL = 1e-4


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    proc = ServerProcess(["--pipeline", "ar_text", "-c", "ar_dtype=fp32"], tmp_path_factory.mktemp("lp") / "log")
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def hf(server, omni_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni_qwen.logprobs import TokenTexts

    path = omni_cache / "demo" / "qwen2-tiny"
    tok = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok, TokenTexts(tok)


def reference(hf, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens after `prompt` and the log-softmax at every position of prompt + them."""
    model = hf[0]
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0].tolist()
    with torch.no_grad():
        return out[len(prompt):], model(torch.tensor([out])).logits[0].log_softmax(-1)


def close(a, b) -> bool:
    return abs(a - b) < TOL


def check_chat(hf, content, prompt, n):
    tokens, ref = reference(hf, prompt, len(content))
    for i, (entry, token) in enumerate(zip(content, tokens)):
        row = ref[len(prompt) + i - 1]
        assert entry.token == hf[2](token)[0] and entry.bytes == hf[2](token)[1]
        assert close(entry.logprob, row[token].item())
        values, ids = row.topk(n)
        assert [t.token for t in entry.top_logprobs] == [hf[2](t)[0] for t in ids.tolist()]
        assert all(close(t.logprob, v) for t, v in zip(entry.top_logprobs, values.tolist()))


def test_chat_logprobs_whole_and_streamed(client, hf):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = client.chat.completions.create(model="ar_text", messages=messages, max_tokens=8, logprobs=True,
                                         top_logprobs=5, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    check_chat(hf, content, list(prompt), 5)
    streamed = []
    for chunk in client.chat.completions.create(model="ar_text", messages=messages, max_tokens=8, logprobs=True,
                                                top_logprobs=5, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="ar_text", messages=messages, max_tokens=8)
    assert plain.choices[0].logprobs is None


def check_completion(hf, logprobs, prompt, new, n, echo=True):
    tokens, ref = reference(hf, prompt, max(new, 1))
    ids = (prompt if echo else []) + tokens[:new]
    assert logprobs["tokens"] == [hf[2](t)[0] for t in ids]
    start = 0 if echo else len(prompt)
    if echo:
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, token in enumerate(ids):
        position = start + i
        if position == 0:
            continue
        row = ref[position - 1]
        assert close(logprobs["token_logprobs"][i], row[token].item())
        top = logprobs["top_logprobs"][i]
        best = row.topk(n).indices
        for t in best.tolist():  # tokens of one text (U+FFFD) share one key
            assert any(close(top[hf[2](t)[0]], row[u].item()) for u in best.tolist() + [token]
                       if hf[2](u)[0] == hf[2](t)[0])
        assert hf[2](token)[0] in top
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))


def sse(http, body):
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def joined(chunks, index):
    text, out = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index:
                text += choice["text"]
                for key in out:
                    out[key] += (choice["logprobs"] or {}).get(key, [])
    return text, out


def test_completions_echo_logprobs_several_prompts_in_one_batch(http, hf):
    prompts = [[5, 77, 300, 12, 9, 800, 41, 3, 17, 250, 66, 90, 1000, 2, 8, 31, 400, 7], [100, 200],
               list(range(40, 90))]
    body = {"model": "ar_text", "prompt": prompts, "max_tokens": 5, "logprobs": 3, "echo": True, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice, prompt in zip(choices, prompts):
        check_completion(hf, choice["logprobs"], prompt, 5, 3)
        assert choice["text"] == "".join(choice["logprobs"]["tokens"])
    chunks = sse(http, body)
    for choice in choices:
        text, logprobs = joined(chunks, choice["index"])
        assert text == choice["text"]
        assert logprobs["tokens"] == choice["logprobs"]["tokens"]  # the floats: up to the batch's rounding
        assert logprobs["text_offset"] == choice["logprobs"]["text_offset"]
        assert all(a is b is None or close(a, b) for a, b in zip(logprobs["token_logprobs"],
                                                                 choice["logprobs"]["token_logprobs"]))


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(http, hf, max_tokens):
    """What lm-eval's local-completions sends for a loglikelihood: token ids, echo, logprobs=1, max_tokens=1
    (0 works too: the prompt alone)."""
    prompt = [11, 230, 45, 600, 3, 99, 150]
    r = http.post("/v1/completions", json={"model": "ar_text", "prompt": [prompt], "max_tokens": max_tokens,
                                           "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + max_tokens
    check_completion(hf, choice["logprobs"], prompt, max_tokens, 1)
    if max_tokens == 0:
        assert choice["finish_reason"] == "length" and r.json()["usage"]["prompt_tokens"] == len(prompt)
        assert joined(sse(http, {"model": "ar_text", "prompt": [prompt], "max_tokens": 0, "logprobs": 1,
                                 "echo": True}), 0)[1] == choice["logprobs"]


def test_completion_text_prompt_logprobs_without_echo(client, hf):
    out = client.completions.create(model="ar_text", prompt="Once upon a time", max_tokens=4, logprobs=2,
                                    extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    prompt = hf[1].encode("Once upon a time")
    check_completion(hf, logprobs.model_dump(), prompt, 4, 2, echo=False)
    echoed = client.completions.create(model="ar_text", prompt="Once upon a time", max_tokens=4, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Once upon a time" + out.choices[0].text
    assert echoed.choices[0].logprobs is None


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
])
def test_bad_logprobs_fields_are_400_naming_them(http, route, body, param):
    text = {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}
    base = {"model": "ar_text", "max_tokens": 2, **text}
    r = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json={**base, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
