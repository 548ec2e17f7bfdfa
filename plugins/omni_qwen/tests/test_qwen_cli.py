"""`omni run --pipeline ar_text` through click's CliRunner, every error case, and the real Qwen2.5 layout."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from omni_kernel.cli import main

PROMPT = "生成1000字的文本，描述一所学校"


def omni(*args):
    result = CliRunner().invoke(main, ["run", "--pipeline", "ar_text", "-c", "ar_device=cpu", *args])
    return result


def test_run_prints_text_and_trace(tiny_ckpt, tmp_path):
    result = omni("--ar-model", str(tiny_ckpt), "--prompt", PROMPT, "--trace-json", str(tmp_path / "t.json"))
    assert result.exit_code == 0, result.output
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["ar.stop_reason"] in ("eos", "context_window")
    assert trace["ar.streaming"] is False and trace["ar.token_budget"] is None
    assert "ar.kv_cache_backend" in result.stderr and '"paged"' in result.stderr
    assert result.stdout.rstrip("\n")


def test_stream_prints_the_same_text(tiny_ckpt):
    streamed = omni("--ar-model", str(tiny_ckpt), "--prompt", PROMPT, "--stream")
    as_json = omni("--ar-model", str(tiny_ckpt), "--prompt", PROMPT, "--json")
    assert streamed.exit_code == 0 and as_json.exit_code == 0, streamed.output + as_json.output
    body = json.loads(as_json.stdout)
    assert streamed.stdout == body["output"]["text"] + "\n"
    assert body["trace"]["ar.streaming"] is False and body["stop_reason"] == body["trace"]["ar.stop_reason"]
    assert any(line.split() == ["ar.streaming", "true"] for line in streamed.stderr.splitlines())


def test_real_qwen25_layout(qwen25_dir, hf_greedy):
    result = omni("--ar-model", str(qwen25_dir), "-c", "ar_dtype=bf16", "--prompt", PROMPT, "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["trace"]["ar.dtype"] == "bf16"
    assert body["trace"]["ar.sampling"] == "greedy"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen25_dir)
    assert not (qwen25_dir / "tokenizer.json").exists()
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               return_dict=False)
    n = body["trace"]["ar.generated_tokens"]
    expected = hf_greedy(qwen25_dir, list(prompt_ids), n)
    assert body["output"]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert body["trace"]["ar.input_tokens"] == len(prompt_ids)


def test_ar_dtype_override(tiny_ckpt, host):
    from omni_kernel import Omni

    result = Omni("ar_text", host=host, ar_model=str(tiny_ckpt), ar_dtype="bf16", ar_device="cpu").generate(
        "hi", max_tokens=3)
    assert result.trace["ar.dtype"] == "bf16"


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory, tiny_ckpt):
    root = tmp_path_factory.mktemp("bad")
    (root / "file.txt").write_text("not a dir")
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "vision").mkdir()
    (root / "vision" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (root / "noweights").mkdir()
    (root / "noweights" / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    (root / "notokenizer").mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (root / "notokenizer" / name).write_bytes((tiny_ckpt / name).read_bytes())
    (root / "badweights").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (root / "badweights" / name).write_bytes((tiny_ckpt / name).read_bytes())
    (root / "badweights" / "model.safetensors").write_bytes(b"garbage")
    return root


@pytest.mark.parametrize("name, message", [
    ("missing", "does not exist"), ("file.txt", "is not a directory"), ("empty", "has no config.json"),
    ("broken", "unreadable config.json"), ("vision", "not a causal language model"),
    ("noweights", "no *.safetensors weights"), ("notokenizer", "no usable tokenizer"),
    ("badweights", "could not be loaded as a causal LM"),
])
def test_bad_model_dir_is_one_line_exit_2(bad_dirs, name, message):
    result = omni("--ar-model", str(bad_dirs / name), "--prompt", "hi")
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", " \n "], "the prompt is empty"),
    (["--prompt", "school " * 300], "context window is 256 tokens"),
    (["--prompt", "hi", "--image", "x.png"], "invalid --image: pipeline 'ar_text' takes no input image"),
    (["--prompt", "hi", "--ar-dtype", "fp32"], "No such option"),
    (["--prompt", "hi", "--top-k", "5"], "No such option"),
    (["--prompt", "hi", "-c", "ar_kv_memroy=1MiB"], "has no config key 'ar_kv_memroy'"),
    (["--prompt", "hi", "-o", "strem=true"], "has no request parameter 'strem'"),
])
def test_bad_request_is_one_line_exit_2(tiny_ckpt, args, message):
    result = omni("--ar-model", str(tiny_ckpt), *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, line", [
    (["--prompt", ""], "Error: the prompt is empty"),
    (["--prompt", " \n "], "Error: the prompt is empty"),
    (["--prompt", "hi", "-o", "messages=user: hi"],
     "Error: invalid messages: give either messages or a prompt (or prompt_token_ids), not both"),
    (["--prompt", "hi", "-o", "regex=a+", "-o", "json_object=true"],
     "Error: invalid regex: give one of json_schema, json_object, regex, choice, not json_object and regex"),
])
def test_a_bad_prompt_is_refused_before_the_model_loads(tiny_ckpt, monkeypatch, args, line):
    """The node type's check (inputs.check_request) runs before anything is built: no model loads for it."""
    from omni_kernel.core.planner import GraphBuilder

    built = []
    monkeypatch.setattr(GraphBuilder, "build", lambda self, plan, *a, **k: built.append(plan.name))
    result = omni("--ar-model", str(tiny_ckpt), *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == line and built == []


def test_bad_dtype_is_refused(tiny_ckpt, host):
    from omni_kernel import Omni
    from omni_kernel.core.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="ar_dtype"):
        Omni("ar_text", host=host, ar_model=str(tiny_ckpt), ar_dtype="int3")


@pytest.mark.real_model  # not a real model, but tens of seconds of torch.compile: outside the fast tier
def test_ar_compile_same_text_and_its_errors(tiny_ckpt, monkeypatch, tmp_path):
    """-c ar_compile=true: the same greedy text as eager, and the load line says so; on the dynamic_cache backend,
    or where inductor has no C++ compiler, one line and exit 2."""
    args = ("--ar-model", str(tiny_ckpt), "--prompt", PROMPT, "-c", "ar_max_num_seqs=4", "--json")
    eager = omni(*args)
    compiled = omni(*args, "-c", "ar_compile=true")
    assert eager.exit_code == 0 and compiled.exit_code == 0, eager.output + compiled.output
    assert json.loads(compiled.stdout)["output"]["text"] == json.loads(eager.stdout)["output"]["text"]
    assert json.loads(compiled.stdout)["trace"]["ar.decode_compiled"] is True
    assert json.loads(eager.stdout)["trace"]["ar.decode_compiled"] is False

    wrong = omni(*args, "-c", "ar_compile=true", "-c", "ar_kv_backend=dynamic_cache")
    assert wrong.exit_code == 2 and "ar_compile" in wrong.stderr and "dynamic_cache" in wrong.stderr, wrong.output

    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached: it must compile
    with inductor_config.patch({"fx_graph_cache": False, "cpp.cxx": (None, str(tmp_path / "no-such-compiler"))}):
        failed = omni(*args, "-c", "ar_compile=true")
    lines = failed.stderr.strip().splitlines()
    says = "Error: ar_compile: torch.compile could not compile the decode step (InvalidCxxCompiler"
    assert failed.exit_code == 2 and lines[-1].startswith(says), failed.output
