"""One AR engine per model and engine settings: ar_text and a prompt-bridge node built on one plugin host share
it (one KV pool, one decode batch), each with its own input and output processing; each pipeline gets back its
own requests' events, token-identical to their solo runs. Other engine settings get an engine of their own."""

from __future__ import annotations

from omni_kernel import NodeSpec, Omni, PipelinePlan, RequestFinished
from omni_kernel.plugins import load_host

# The answer format omni_bridge's pipelines give the node (omni_bridge/guidance.py owns it).
GUIDANCE_FORMAT = {"answer_prefix": '{"guidance": "', "output_contract": "supplemental_guidance"}
BRIDGE_ONLY = PipelinePlan("bridge_only", [NodeSpec("bridge", "ar.prompt_bridge", policy=GUIDANCE_FORMAT, final=True)])


def test_ar_text_and_the_bridge_share_one_engine_and_one_decode_batch(omni_cache):
    from omni_qwen.demo import ensure_demo_checkpoint

    host, model = load_host(), str(ensure_demo_checkpoint())  # a context window that holds the bridge's few-shot chat
    text = Omni("ar_text", host=host, ar_model=model, ar_device="cpu")
    bridge = Omni(BRIDGE_ONLY, host=host, ar_model=model, ar_device="cpu")
    other = Omni("ar_text", host=host, ar_model=model, ar_device="cpu", ar_max_num_seqs=3)
    a, b = text.graph.stages["generate"], bridge.graph.stages["bridge"]
    assert a.engine is b.engine and a.inputs is not b.inputs and a.outputs is not b.outputs
    assert other.graph.stages["generate"].engine is not a.engine  # other engine settings
    assert a.stats().kv_blocks_total == b.stats().kv_blocks_total  # one pool, reported by both

    runner = a.engine.runner
    batches, real = [], runner.run

    def spy(batch):
        batches.append({seq.request_id for seq in batch.records})
        return real(batch)

    runner.run = spy
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    try:
        text.submit(text.request("Describe a school", request_id="t", **params))
        bridge.submit(bridge.request("a lighthouse at dusk", request_id="b", temperature=0))
        events = {text: [], bridge: []}
        while text.has_unfinished() or bridge.has_unfinished():  # each in turn, as `omni serve`'s engine thread
            for o in (text, bridge):
                if o.has_unfinished():
                    events[o] += o.step()
    finally:
        del runner.run
    assert {"t", "b"} in batches  # one forward for both pipelines
    assert {e.request_id for e in events[text]} == {"t"} and {e.request_id for e in events[bridge]} == {"b"}
    together = {o: next(e.result for e in events[o] if isinstance(e, RequestFinished)) for o in events}
    assert together[bridge].outputs["bridge"].contract == "supplemental_guidance"  # the bridge's own output processing
    assert together[text].outputs["generate"].contract is None
    solo_text = text.generate("Describe a school", **params)
    solo_bridge = bridge.generate("a lighthouse at dusk", temperature=0)
    assert together[text].outputs["generate"].data["token_ids"] == solo_text.outputs["generate"].data["token_ids"]
    assert together[bridge].outputs["bridge"].data["token_ids"] == solo_bridge.outputs["bridge"].data["token_ids"]
    assert not a.engine.scheduler.sequences
