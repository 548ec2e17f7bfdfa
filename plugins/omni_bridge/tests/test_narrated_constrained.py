"""The narrated pipelines' AR node on the real grammar engine: constrained to the narrated schema, even the tiny
random demo model writes one object with both fields, in budget (the schema bounds them), and each connector reads
its own field: the guidance for the video, the narration for the voice."""

from __future__ import annotations

import json

import pytest

from omni_bridge.guidance import GUIDANCE_MAX_CHARS, NARRATION_MAX_CHARS
from omni_bridge.narrated import NARRATED_POLICY
from omni_kernel import NodeSpec, Omni, PipelinePlan, RequestFinished
from omni_kernel.plugins import load_host

PROMPTS = ("a red fox trotting through fresh snow", "雨の東京", "a lighthouse at dusk", "x")


@pytest.fixture(scope="module")
def host():
    return load_host()


def test_constrained_narrated_answers_always_carry_both_fields(host):
    plan = PipelinePlan("narrated_bridge_only", [NodeSpec("bridge", "ar.prompt_bridge", policy=NARRATED_POLICY,
                                                          final=True)])
    omni = Omni(plan, host=host, ar_device="cpu")
    requests = [omni.request(p, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)]
    outputs = {e.request_id: e.result.output for e in omni.run(requests) if isinstance(e, RequestFinished)}
    video = host.registry.connectors["ar_to_diffusion"].item
    voice = host.registry.connectors["guidance_to_speech"].item
    for request in requests:
        output = outputs[request.request_id]
        answer = json.loads(output.text)
        assert output.stop_reason == "stop" and list(answer) == ["guidance", "narration"], output.text
        assert 1 <= len(answer["guidance"]) <= GUIDANCE_MAX_CHARS
        assert 1 <= len(answer["narration"]) <= NARRATION_MAX_CHARS
        assert video.convert(output, request).trace["diffusion.bridge_parse_success"] is True
        spoken = voice.convert(output, request)
        assert spoken.trace["narration.parse_success"] is True and spoken.prompt == spoken.trace["narration.text"]
