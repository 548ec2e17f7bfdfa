"""Property tests: whatever the AR stage writes, the connector converts without raising and stays consistent."""

import json
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from omni_bridge import FALLBACK_REASONS, ARToDiffusionConnector, merge_prompt
from omni_kernel import TRUNCATED_STOP_REASONS, Request, StageOutput

CONNECTOR = ARToDiffusionConnector()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3),
    max_leaves=10)
guidance_objects = st.fixed_dictionaries({"guidance": st.text() | json_values},
                                         optional={"camera": st.text(), "style": json_values})
prose = st.text(max_size=30)
json_texts = st.builds(lambda value, ascii_: json.dumps(value, ensure_ascii=ascii_), json_values | guidance_objects,
                       st.booleans())
wrapped = st.builds(lambda before, body, after, fence: f"{before}```json\n{body}\n```{after}" if fence
                    else f"{before}{body}{after}", prose, json_texts, prose, st.booleans())
jsonish = st.text(alphabet=st.sampled_from('{}[]":,\\ \nguidance0-9.tfnul\u00e9\u4e16'), max_size=60)
ar_texts = st.none() | st.text() | json_texts | wrapped | jsonish
stop_reasons = (st.none() | st.sampled_from(["eos", "stop", "max_tokens", "length", "context_window"])
                | st.text(max_size=12))
contracts = st.sampled_from(["supplemental_guidance", None]) | st.text(max_size=12)


def _request(prompt, image):
    return Request("qwen_to_wan_i2v", prompt, image=image, params={"seed": 1, "output": "out.mp4"})


@settings(max_examples=300, deadline=None)
@given(prompt=st.text(), image=st.none() | st.text(max_size=10), text=ar_texts, stop=stop_reasons, contract=contracts)
def test_the_connector_never_raises_and_its_trace_agrees(prompt, image, text, stop, contract):
    request = _request(prompt, image)
    output = StageOutput(request.request_id, "bridge", text=text, stop_reason=stop, contract=contract)
    item = CONNECTOR.convert(output, request)
    trace = item.trace
    assert item.prompt.startswith(prompt)
    assert trace["diffusion.prompt"] == item.prompt
    assert (item.request_id, item.image, item.params, item.processed) == (request.request_id, image, None, None)
    success, fallback, reason = (trace["diffusion.bridge_parse_success"], trace["diffusion.bridge_fallback"],
                                 trace["diffusion.bridge_fallback_reason"])
    assert success is (not fallback)
    assert (reason is None) is success
    assert reason is None or reason in FALLBACK_REASONS
    guidance = trace["diffusion.ar_guidance_prompt"]
    if success:
        assert guidance and guidance == " ".join(guidance.split())
        assert not any(unicodedata.category(c) in ("Cc", "Cs") for c in guidance)
        assert item.prompt == merge_prompt(prompt, guidance)
    else:
        assert guidance is None and item.prompt == prompt
    if stop in TRUNCATED_STOP_REASONS and contract in (None, "supplemental_guidance"):
        assert not success
    json.dumps(trace, ensure_ascii=False).encode("utf-8")


@settings(deadline=None)
@given(prompt=st.text(min_size=1), guidance=st.text(), before=st.text(max_size=20).filter(lambda s: "{" not in s),
       after=st.text(max_size=20), fence=st.booleans())
def test_a_guidance_object_amid_prose_is_found(prompt, guidance, before, after, fence):
    body = json.dumps({"guidance": guidance, "camera": "static"})
    text = f"{before}```json\n{body}\n```{after}" if fence else f"{before}{body}{after}"
    request = _request(prompt, None)
    item = CONNECTOR.convert(StageOutput(request.request_id, "bridge", text=text, stop_reason="eos"), request)
    cleaned = " ".join("".join(" " if unicodedata.category(c) in ("Cc", "Cs") else c for c in guidance).split())
    assert item.trace["diffusion.bridge_parse_success"] is bool(cleaned)
    assert item.trace["diffusion.ar_guidance_prompt"] == (cleaned or None)
