"""Plugin registration, the torch-free entry module, model caching, the demo checkpoint and the installed script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_kernel import NodeSpec, PipelinePlan
from omni_kernel.core.params import options_of
from omni_kernel.core.planner import GraphBuilder
from omni_qwen.config import QwenConfig, QwenParams


@pytest.mark.cli_subprocess
def test_entry_module_imports_no_torch():
    code = "import sys, omni_qwen.plugin; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_registers_nodes_and_pipeline(host):
    registry = host.registry
    assert registry.pipelines["ar_text"].plugin == "omni_qwen"
    text = registry.node_types["ar.text_generation"].item
    bridge = registry.node_types["ar.prompt_bridge"].item
    assert (text.kind, bridge.kind) == ("ar", "ar")
    assert (text.config, text.params) == (bridge.config, bridge.params) == (QwenConfig, QwenParams)
    config, params = options_of(QwenConfig), options_of(QwenParams)
    assert all(name.startswith("ar_") for name in config)  # one flat config namespace with other plugins
    assert config["ar_model"].flag == "--ar-model" and config["ar_kv_backend"].choices == ("paged", "dynamic_cache")
    assert [n for n, info in config.items() if info.flag] == ["ar_model"]
    assert {"stream", "max_tokens", "stop", "seed", "ignore_eos", "prompt_token_ids"} <= set(params)
    assert params["prompt_token_ids"].flag is None and params["prompt_token_ids"].multiple


def test_model_loads_once_per_path(host, tiny_ckpt):
    plan = PipelinePlan("two", [NodeSpec("a", "ar.prompt_bridge"), NodeSpec("b", "ar.text_generation", final=True)])
    graph = GraphBuilder(host.registry).build(plan, {"ar_model": str(tiny_ckpt), "ar_device": "cpu"})
    a, b = graph.stages["a"], graph.stages["b"]
    lm = a.outputs.decode.__self__
    assert b.outputs.decode.__self__ is lm  # one CausalLM (model and tokenizer), owned by the plugin
    # the stages tokenize with one copy of the model's tokenizer (made once), so a stage worker may process an
    # input beside a step that decodes with the model's (a fast tokenizer used from two threads can fail "Already
    # borrowed")
    assert a.inputs.tokenizer is b.inputs.tokenizer and a.inputs.tokenizer is not lm.tokenizer
    assert a.concurrent_inputs and b.concurrent_inputs
    assert a.inputs.tokenizer.encode("a red fox") == lm.tokenizer.encode("a red fox")
    assert a.engine.runner.backend.model is b.engine.runner.backend.model  # one PagedDecoder, owned by the plugin
    assert a.engine is b.engine  # and one engine (one KV pool, one batch) under both nodes' stages


def test_demo_checkpoint_is_built_once(omni_cache):
    from omni_qwen.demo import DEMO_CONTEXT_WINDOW, demo_dir, ensure_demo_checkpoint

    path = ensure_demo_checkpoint()
    assert path == demo_dir() and path.parent.parent == omni_cache
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "a temp build dir was left behind"
    import json

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["max_position_embeddings"] == DEMO_CONTEXT_WINDOW


@pytest.mark.cli_subprocess
def test_installed_script_runs_ar_text_on_the_demo(omni_cache):
    script = Path(sys.executable).with_name("omni")
    # One thread: a tiny model gains nothing from more, and OpenMP spinning on a busy machine costs 10-30x.
    env = {**os.environ, "OMNI_CACHE_DIR": str(omni_cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(script), "run", "--pipeline", "ar_text", "--stream", "--prompt",
                           "生成1000字的文本，描述一所学校"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "default AR model: the tiny random-weight demo model (OMNI_AR_DEFAULT=tiny)" in proc.stderr
    assert proc.stderr.count("default AR model:") == 1, proc.stderr  # said once, not at each check of the plan
    assert "paged KV backend" in proc.stderr and "max concurrency" in proc.stderr
    assert proc.stdout.strip()
    lines = {line.split()[0]: line.split(None, 1)[1] for line in proc.stderr.splitlines() if line.startswith("ar.")}
    assert lines["ar.streaming"] == "true" and lines["ar.kv_cache_backend"] == '"paged"'
    assert lines["ar.stop_reason"] in ('"eos"', '"context_window"')
