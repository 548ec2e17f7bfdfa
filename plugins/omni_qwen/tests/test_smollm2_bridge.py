"""The bridge node on real weights (SmolLM2-135M-Instruct): its answer is the contract's one JSON object with
guidance of the model's own (not copied from the instruction). Skipped, naming the fetch command, when the
model is not in omni's cache. benchmarks/bridge_rate.py measures the rate over 20 prompts."""

import json

import pytest

from omni_qwen.bridge_prompt import bridge_prompt

pytestmark = [pytest.mark.real_model]

ANSWER_PREFIX = '{"guidance": "'  # the answer format omni_bridge's pipelines give the node (not its schema)
GUIDANCE_FORMAT = {"answer_prefix": ANSWER_PREFIX, "output_contract": "supplemental_guidance"}


@pytest.mark.parametrize("prompt", ["A red fox trotting through fresh snow in a pine forest",
                                    "Waves crashing against black volcanic sand on an Icelandic beach"])
def test_bridge_answers_with_one_json_object(smollm2_dir, run_plan, prompt):
    result = run_plan("ar.prompt_bridge", prompt, {"ar_model": str(smollm2_dir), "ar_kv_memory": "64MiB"},
                      policy=GUIDANCE_FORMAT)
    out = result.output
    assert out.stop_reason == "eos" and out.contract == "supplemental_guidance"
    assert out.text.startswith(ANSWER_PREFIX)
    guidance = json.loads(out.text)["guidance"]
    assert len(guidance.split()) >= 5 and guidance not in bridge_prompt("", ANSWER_PREFIX)
    assert result.trace["ar.output_tokens"] < 64
