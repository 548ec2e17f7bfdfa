"""The pipelines' bridge node is constrained to the guidance schema: even the tiny random model's answers parse
(the schema bounds the guidance, so the node's token budget never cuts it), and the trace says it was constrained."""

from __future__ import annotations

import pytest

from omni_bridge.guidance import GUIDANCE_MAX_CHARS
from omni_bridge.pipeline import BRIDGE_POLICY, QWEN_TO_WAN_I2V
from omni_kernel import GraphError, NodeSpec, Omni, PipelinePlan, RequestFinished
from omni_kernel.core.planner import GraphBuilder
from omni_kernel.plugins import load_host

PROMPTS = ("a red fox trotting through fresh snow", "雨の東京", "a lighthouse at dusk", "x")


@pytest.fixture(scope="module")
def host():
    return load_host()


def bridge_outputs(host, policy, **params):
    plan = PipelinePlan("bridge_only", [NodeSpec("bridge", "ar.prompt_bridge", policy=policy, final=True)])
    omni = Omni(plan, host=host, ar_device="cpu")
    requests = [omni.request(p, temperature=1.0, seed=i, **params) for i, p in enumerate(PROMPTS)]
    for request in requests:
        omni.submit(request)
    outputs = {}
    while omni.has_unfinished():
        for event in omni.step():
            assert isinstance(event, RequestFinished) or not hasattr(event, "error"), event
            if isinstance(event, RequestFinished):
                outputs[event.request_id] = event.result.output
    return [(outputs[r.request_id], r) for r in requests]


def test_the_pipelines_bridge_node_is_constrained_to_the_guidance_schema():
    assert QWEN_TO_WAN_I2V.nodes[0].policy == BRIDGE_POLICY


def test_constrained_bridge_answers_always_parse(host):
    connector = host.registry.connectors["ar_to_diffusion"].item
    for output, request in bridge_outputs(host, BRIDGE_POLICY):
        trace = connector.convert(output, request).trace
        assert trace["diffusion.bridge_constrained"] is True
        assert trace["diffusion.bridge_parse_success"], output.text
        assert output.stop_reason == "stop" and output.text.startswith('{"guidance": "')
        assert 1 <= len(trace["diffusion.ar_guidance_prompt"]) <= GUIDANCE_MAX_CHARS


def test_unconstrained_bridge_says_so(host):
    connector = host.registry.connectors["ar_to_diffusion"].item
    output, request = bridge_outputs(host, {}, max_tokens=8)[0]
    assert connector.convert(output, request).trace["diffusion.bridge_constrained"] is False


def test_a_bad_policy_schema_is_refused_when_the_plan_is_built(host):
    plan = PipelinePlan("bad", [NodeSpec("bridge", "ar.prompt_bridge", policy={"json_schema": {"type": "nope"}},
                                         final=True)])
    refused = "node 'bridge': policy invalid json_schema: .*Unsupported type \"nope\""
    with pytest.raises(GraphError, match=refused) as info:
        GraphBuilder(host.registry).prepare(plan, {"ar_device": "cpu"})  # nothing loads
    assert info.value.rule == "node_policy"


def test_a_shared_engine_keeps_each_requests_own_prefix(omni_cache):
    """ar_text and the constrained bridge node share one AR engine (one model): the bridge's grammar covers its
    answer prefix, a constrained ar_text request's grammar starts at its first token, in the same batches."""
    import json

    from omni_kernel import Omni
    from omni_qwen.demo import ensure_demo_checkpoint

    host, model = load_host(), str(ensure_demo_checkpoint())
    text = Omni("ar_text", host=host, ar_model=model, ar_device="cpu")
    bridge = Omni(PipelinePlan("bridge_only", [NodeSpec("bridge", "ar.prompt_bridge", policy=BRIDGE_POLICY,
                                                        final=True)]), host=host, ar_model=model, ar_device="cpu")
    assert text.graph.stages["generate"].engine is bridge.graph.stages["bridge"].engine
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text.submit(text.request("x", request_id="t", json_schema=schema))
    bridge.submit(bridge.request("a lighthouse at dusk", request_id="b", temperature=1.0, seed=2))
    results = {}
    while text.scheduler.has_unfinished():  # the host's one scheduler: one round steps the shared engine once
        for event in text.scheduler.step():
            if isinstance(event, RequestFinished):
                results[event.request_id] = event.result.output
    assert isinstance(json.loads(results["t"].text)["ok"], bool)
    guidance = json.loads(results["b"].text)["guidance"]
    assert results["b"].text.startswith('{"guidance": "') and 1 <= len(guidance) <= GUIDANCE_MAX_CHARS
