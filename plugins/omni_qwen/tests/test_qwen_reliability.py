"""Reliability corpus for the AR stage (demo model): sampling edge values in one batch with good requests,
checkpoints that do not match their config (one ModelError line, nothing unpickled, no library report on
stderr), Python API mistakes, and resource stability over 300 requests through one Omni object."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from omni_kernel import Omni
from omni_kernel.cli import main
from omni_kernel.core.errors import InputError, InvalidParameter, ModelError
from omni_kernel.core.params import MAX_SEED, ARParams
from omni_kernel.core.request import Request


@pytest.fixture(scope="module")
def ar(omni_cache):
    return Omni("ar_text", ar_device="cpu")


def _run_all(omni: Omni, requests: list[Request]) -> dict[str, object]:
    """Submit every request at once (one decode batch) and collect each one's text or exception."""
    from omni_kernel.events import RequestFailed, RequestFinished

    for r in requests:
        omni.submit(r)
    done: dict[str, object] = {}
    while omni.has_unfinished():
        for event in omni.step():
            if isinstance(event, RequestFinished):
                done[event.request_id] = event.result.text
            elif isinstance(event, RequestFailed):
                done[event.request_id] = event.exception()
    return done


GOOD = [dict(), dict(temperature=0.8, seed=7), dict(temperature=1.3, top_k=5, seed=11), dict(top_p=0.5,
                                                                                             temperature=1.0, seed=3)]
EDGE = [dict(temperature=1e-300, seed=1), dict(temperature=5e-324, seed=2), dict(temperature=1e-5, seed=3),
        dict(temperature=1e300, seed=4), dict(temperature=1.0, top_p=1e-300, seed=5),
        dict(temperature=1.0, top_k=1, seed=6), dict(temperature=1.0, top_k=10**9, seed=7),
        dict(temperature=2.0, seed=0), dict(temperature=2.0, seed=MAX_SEED), dict(temperature=0.5, max_tokens=1),
        dict(temperature=1e-300, top_p=1e-300, top_k=1, seed=MAX_SEED)]


def test_edge_values_never_fail_their_batch(ar):
    prompt = "Describe the weather in Paris in spring."
    solo = [ar.generate(prompt, max_tokens=12, **p).text for p in GOOD]
    good = [ar.request(prompt, max_tokens=12, **p) for p in GOOD]
    edge = [ar.request(prompt, **{"max_tokens": 12, **p}) for p in EDGE]
    done = _run_all(ar, [*good[:2], *edge, *good[2:]])
    assert [done[r.request_id] for r in good] == solo
    for r in edge:
        assert isinstance(done[r.request_id], str), done[r.request_id]  # each edge request finished
    greedy = ar.generate(prompt, max_tokens=12).text
    assert done[edge[0].request_id] == greedy  # a temperature under the floor samples the argmax


def test_nan_logits_fail_one_row_only():
    from omni_qwen.sampling import Sampler, Sampling

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    rows = [Sampling.of(ARParams(temperature=1e-300, seed=1)), Sampling.of(ARParams(temperature=1.0, seed=2)),
            Sampling.of(ARParams()), Sampling.of(ARParams(temperature=1.0, top_p=1e-300, seed=3))]
    tokens = Sampler().sample(logits, rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[3] == int(logits[3].argmax())  # top_p that rounds to 0 keeps the best token
    assert isinstance(tokens[1], RuntimeError) and "NaN" in str(tokens[1])


def test_probabilities_are_finite_for_every_valid_value():
    from omni_qwen.sampling import probabilities

    logits = torch.randn(1, 100) * 30
    for t in (1e-300, 5e-324, 1e-5, 1e-3, 1.0, 1e5, 1e300):
        for top_p in (1e-300, 0.3, 1.0):
            for top_k in (-1, 1, 7, 10**9):
                probs = probabilities(logits, [ARParams(temperature=t, top_p=top_p, top_k=top_k, seed=1)])
                assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-4, (t, top_p, top_k)


# Python API mistakes: one-line InvalidParameter / InputError naming the field.
API_CASES = {
    "params as a dict keyword": (lambda o: o.generate("x", ar={"max_tokens": 3}), InvalidParameter, "ar"),
    "garbage keyword": (lambda o: o.generate("x", diffusion=object()), InvalidParameter, "diffusion"),
    "misspelled key": (lambda o: o.generate("x", max_tokns=3), InvalidParameter, "max_tokns"),
    "lone surrogate prompt": (lambda o: o.generate("bad \ud800"), InvalidParameter, "UTF-8"),
    "bytes prompt": (lambda o: o.generate(b"x"), InvalidParameter, "prompt"),
    "empty prompt": (lambda o: o.generate(""), InputError, "empty"),
    "whitespace prompt": (lambda o: o.generate(" \n\t "), InputError, "empty"),
    "token id outside vocab": (lambda o: o.generate("x", prompt_token_ids=[10**6]), InvalidParameter,
                               "prompt_token_ids"),
    "negative token id": (lambda o: o.generate("x", prompt_token_ids=[-1]), InvalidParameter, "prompt_token_ids"),
    "seed 2**70": (lambda o: o.generate("x", temperature=1.0, seed=2**70), InvalidParameter, "seed"),
    "temperature inf": (lambda o: o.generate("x", temperature=float("inf")), InvalidParameter, "temperature"),
    "prompt over the context window": (lambda o: o.generate("word " * 600), InputError, "context window"),
    "prompt over any prompt that fits": (lambda o: o.generate("word " * 2000), InvalidParameter, "context window"),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_api_mistake_is_one_line(case, ar):
    call, kind, expected = API_CASES[case]
    with pytest.raises(kind) as info:
        call(ar)
    assert len(str(info.value).splitlines()) == 1 and expected in str(info.value), str(info.value)
    assert not ar.has_unfinished()


def test_cli_tiny_temperature_runs(omni_cache):
    result = CliRunner().invoke(main, ["run", "--pipeline", "ar_text", "--prompt", "hi", "--temperature", "1e-300",
                                       "--seed", str(MAX_SEED), "--max-tokens", "3", "-c", "ar_device=cpu"])
    assert result.exit_code == 0, result.output


# Checkpoints that do not match their config.
def _mutated(src: Path, dst: Path, mutate) -> Path:
    shutil.copytree(src, dst)
    mutate(dst)
    return dst


def _weights(d):
    from safetensors.torch import load_file

    return load_file(d / "model.safetensors")


def _save(d, w):
    from safetensors.torch import save_file

    save_file(w, d / "model.safetensors", metadata={"format": "pt"})


def _drop(d):
    w = _weights(d)
    w.pop("model.layers.0.mlp.up_proj.weight")
    _save(d, w)


def _extra(d):
    _save(d, {**_weights(d), "model.layers.7.extra.weight": torch.zeros(2)})


def _shape(d):
    _save(d, {**_weights(d), "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})


def _config(key, value):
    def mutate(d):
        body = json.loads((d / "config.json").read_text())
        body[key] = value
        (d / "config.json").write_text(json.dumps(body))
    return mutate


def _index(target, pickle=False):
    def mutate(d):
        if pickle:
            class Payload:
                def __reduce__(self):
                    return (open, (str(d / "UNPICKLED"), "w"))
            torch.save({"x": Payload()}, d / target)
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: target for k in _weights(d)}}))
    return mutate


CHECKPOINTS = {
    "missing tensor": (_drop, "missing tensor"),
    "unexpected tensor": (_extra, "unexpected tensor"),
    "shape mismatch": (_shape, "has shape [3, 3]"),
    "max_position_embeddings absurd": (_config("max_position_embeddings", 10**15), "max_position_embeddings"),
    "max_position_embeddings text": (_config("max_position_embeddings", "lots"), "max_position_embeddings"),
    "max_position_embeddings 0": (_config("max_position_embeddings", 0), "max_position_embeddings"),
    "hidden_size negative": (_config("hidden_size", -4), "hidden_size"),
    "vocab_size absurd": (_config("vocab_size", 10**12), "vocab_size"),
    "index points at a pickle": (_index("pytorch_model.bin", pickle=True), "not a .safetensors file"),
    "index points outside the directory": (_index("../model.safetensors"), "not a .safetensors file"),
    "index names a missing shard": (_index("model-00001-of-00002.safetensors"), "missing"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_checkpoint_refused_in_one_line(case, omni_cache, tmp_path, capfd):
    from omni_qwen.demo import ensure_demo_checkpoint
    from omni_qwen.model import CausalLM

    mutate, expected = CHECKPOINTS[case]
    ckpt = _mutated(ensure_demo_checkpoint(), tmp_path / "ckpt", mutate)
    with pytest.raises(ModelError) as info:
        CausalLM.load(ckpt, device="cpu")
    message = str(info.value)
    assert len(message.splitlines()) == 1 and expected in message, message
    assert not (ckpt / "UNPICKLED").exists()
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", captured.err


def test_cli_bad_checkpoint_is_exit_2(omni_cache, tmp_path):
    from omni_qwen.demo import ensure_demo_checkpoint

    ckpt = _mutated(ensure_demo_checkpoint(), tmp_path / "ckpt", _drop)
    result = CliRunner().invoke(main, ["run", "--pipeline", "ar_text", "--prompt", "hi", "--ar-model", str(ckpt)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing tensor" in lines[0] and "Traceback" not in result.output


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RSS is read from /proc")
def test_300_requests_leave_no_blocks_and_flat_rss(ar):
    """300 short requests (mixed greedy/sampled, some failing) through one Omni: the KV pool ends with no used
    block (prefix-cached blocks aside) and RSS stays within 5% of its value after warm-up."""
    stage = ar.graph.stages["generate"]
    blocks = stage.engine.scheduler.blocks

    def batch(n, offset):
        reqs = [ar.request(f"request {offset + i} about the school", max_tokens=4,
                           **({"temperature": 0.9, "seed": i} if i % 2 else {})) for i in range(n)]
        return _run_all(ar, reqs)

    batch(50, 0)  # warm-up
    rss_before = _rss_kib()
    for k in range(5):
        done = batch(50, 1000 * (k + 1))
        assert all(isinstance(v, str) for v in done.values())
    rss_after = _rss_kib()
    assert blocks.num_used == 0
    print(f"RSS after warm-up {rss_before} KiB, after 250 more requests {rss_after} KiB "
          f"({100 * (rss_after - rss_before) / rss_before:+.2f}%); used blocks {blocks.num_used}, "
          f"cached {blocks.num_cached}")
    assert rss_after <= rss_before * 1.05
