"""qwen_to_wan_i2v through the kernel's StageScheduler, with fake stages registered under the real node names."""

import pytest

from omni_bridge.plugin import BridgePlugin
from omni_kernel import ARParams, GraphError, Omni, RequestFinished, StageProgress
from omni_kernel.plugins import PluginHost

from bridge_fakes import REPLIES, FakeModels, make_host


def test_bridge_registers_its_connectors_pipelines_and_the_mux():
    host = PluginHost()
    host.register(BridgePlugin(), "omni_bridge")
    assert host.registry.by_plugin("omni_bridge") == {
        "node types": ["mux.av_mp4"], "connectors": ["ar_to_diffusion", "guidance_to_speech", "speech_to_mux",
                                                     "video_to_mux"],
        "pipelines": ["narrated_i2v", "narrated_t2v", "qwen_to_wan_i2v", "qwen_to_wan_t2v"], "commands": []}
    for name, image in (("qwen_to_wan_i2v", None), ("qwen_to_wan_t2v", "none")):
        plan = host.registry.pipelines[name].item
        assert [(n.id, n.type, n.final, n.plugin_hint) for n in plan.nodes] == [
            ("bridge", "ar.prompt_bridge", False, "omni-qwen"), ("video", "diffusion.wan22_i2v", True, "omni-wan")]
        assert plan.nodes[1].policy.get("image") == image  # the Wan node's image policy (omni_wan's inputs.py)
        assert [(e.source, e.target, e.connector) for e in plan.edges] == [("bridge", "video", "ar_to_diffusion")]


def test_guidance_is_routed_into_the_diffusion_stage_and_the_trace():
    models = FakeModels()
    omni = Omni("qwen_to_wan_i2v", host=make_host(models))
    events = list(omni.generate_stream("a fox in snow", image="fox.png", preset="smoke", seed=7, output="fox.mp4"))
    result = events[-1].result
    assert result.path == "fox.mp4"
    assert result.outputs["bridge"].text.endswith('"slow dolly-in, soft light"}')
    (item,) = models.wan.received.values()
    assert item.prompt == "a fox in snow\n\nSupplemental guidance: slow dolly-in, soft light"
    # one flat set of request parameters: each node gets its own declared fields, --seed reaches both
    assert (item.image, item.params) == ("fox.png", type(item.params)(preset="smoke", seed=7, output="fox.mp4"))
    assert omni.graph.node_types["bridge"].params is ARParams
    assert [(e.node_id, e.step, e.total) for e in events if isinstance(e, StageProgress)] == [
        ("video", 0, 2), ("video", 1, 2), ("video", 2, 2)]
    assert not models.wan.items  # freed when finished
    trace = result.trace
    assert trace["ar.stop_reason"] == "eos" and trace["diffusion.num_inference_steps"] == 2
    assert {k: trace[k] for k in item.trace} == dict(item.trace)
    assert trace["diffusion.bridge"] == "ar_to_diffusion"
    assert trace["diffusion.source_node"] == "bridge"
    assert trace["diffusion.source_request_id"] == result.request_id
    assert trace["diffusion.bridge_strategy"] == "append"
    assert trace["diffusion.bridge_parse_success"] is True and trace["diffusion.bridge_fallback"] is False
    assert trace["diffusion.bridge_fallback_reason"] is None
    assert trace["diffusion.ar_guidance_prompt"] == "slow dolly-in, soft light"
    assert trace["diffusion.prompt"] == item.prompt


def test_concurrent_requests_each_get_their_own_bridge_outcome():
    models = FakeModels()
    omni = Omni("qwen_to_wan_i2v", host=make_host(models))
    requests = {prompt: omni.request(prompt, image="in.png") for prompt in REPLIES}
    for request in requests.values():
        omni.submit(request)
    finished = {}
    while omni.has_unfinished():
        finished |= {e.request_id: e.result for e in omni.step() if isinstance(e, RequestFinished)}
    outcome = {prompt: (finished[r.request_id].trace["diffusion.bridge_fallback_reason"],
                        models.wan.received[r.request_id].prompt) for prompt, r in requests.items()}
    # batched as in production (wan_max_batch 16): the three arrive together, so each of their five Wan steps
    # (prepare, two denoise steps, decode, export) runs all three at the same phase and step
    steps = [models.wan.phases[i:i + 3] for i in range(0, len(models.wan.phases), 3)]
    assert [{(phase, step) for _, phase, step in batch} for batch in steps] == [
        {("prepare", 0)}, {("denoise", 1)}, {("denoise", 2)}, {("decode", 3)}, {("export", 4)}]
    assert all({rid for rid, _, _ in batch} == {r.request_id for r in requests.values()} for batch in steps)
    assert outcome == {"a fox in snow": (None, "a fox in snow\n\nSupplemental guidance: slow dolly-in, soft light"),
                       "a cat on a roof": ("truncated", "a cat on a roof"),
                       "a boat at sea": ("invalid_json", "a boat at sea")}


@pytest.mark.parametrize(("only", "plugin"), [((), "omni-qwen"), (("ar.prompt_bridge",), "omni-wan"),
                                              (("diffusion.wan22_i2v",), "omni-qwen")])
def test_a_missing_node_type_names_the_plugin_to_install(only, plugin):
    with pytest.raises(GraphError) as info:
        Omni("qwen_to_wan_i2v", host=make_host(FakeModels(only)))
    assert info.value.rule == "unknown_node_type"
    assert "install" in str(info.value) and plugin in str(info.value)
