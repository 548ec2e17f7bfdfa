"""`voice_chat`: Whisper's transcript is the AR stage's prompt and the answer is spoken while it is written.

Its AR input equals `asr` alone on the same audio: the `hear` node's transcript is `asr`'s, and the answer is
`ar_text`'s for that transcript (greedy, token for token), so the AR stage was given exactly that text. A request
with no audio, or with a bad AR parameter, is refused at submit, before any work. Real weights: Whisper tiny.en,
SmolLM2 and the Piper voice; a recording of real speech."""

from __future__ import annotations

import pytest

from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.events import AudioDelta, RequestFinished, StageFinished, TokenDelta


@pytest.fixture(scope="module")
def models(whisper_dir, smollm2_dir, voice_dir) -> dict[str, str]:
    return {"asr_model": str(whisper_dir), "ar_model": str(smollm2_dir), "tts_model": str(voice_dir)}


def test_the_ar_input_is_the_transcript_asr_alone_makes_and_the_answer_is_spoken_as_it_is_written(models,
                                                                                                 recordings):
    from omni_kernel import Omni

    audio, _ = recordings["quick_brown_fox"]
    params = {"max_tokens": 40, "seed": 5}
    with Omni("voice_chat", **models) as omni:
        events = list(omni.generate_stream("", audio=str(audio), **params))
    with Omni("asr", asr_model=models["asr_model"]) as omni:
        heard = omni.generate("", audio=str(audio)).text
    with Omni("ar_text", ar_model=models["ar_model"]) as omni:
        answered = omni.generate(heard.strip(), **params)
    result = next(e.result for e in events if isinstance(e, RequestFinished))
    assert result.outputs["hear"].text == heard and "fox" in heard.lower()
    answer = result.outputs["answer"]
    assert answer.text == answered.text and answer.data["token_ids"] == answered.output.data["token_ids"]
    assert result.finals == ("answer", "speak") and result.output is answer
    assert result.trace["voice_chat.heard_chars"] == len(heard.strip())
    deltas = [e for e in events if isinstance(e, AudioDelta)]
    assert deltas and b"".join(d.pcm for d in deltas) == result.outputs["speak"].data["audio"].pcm
    heard_at = next(i for i, e in enumerate(events) if isinstance(e, StageFinished) and e.node_id == "hear")
    first_answer = next(i for i, e in enumerate(events) if isinstance(e, TokenDelta) and e.node_id == "answer")
    assert heard_at < first_answer
    assert 0 < result.trace["tts.first_audio_ms"] <= result.trace["request.elapsed_ms"] + 50


@pytest.mark.parametrize("inputs, params, error, field", [
    ({}, {}, InputError, None),  # no audio: Whisper's check
    ({"audio": "AUDIO"}, {"temperature": -1.0}, InvalidParameter, "temperature"),
    ({"audio": "AUDIO"}, {"voice": "nobody"}, InvalidParameter, "voice"),
    ({"audio": "AUDIO"}, {"messages": [("user", "hi")]},
     InvalidParameter, "messages"),  # the AR node's own check, on the transcript's stand-in
])
def test_bad_requests_are_refused_at_submit_before_any_work(models, recordings, inputs, params, error, field):
    from omni_kernel import Omni

    audio, _ = recordings["hello_world"]
    inputs = {k: str(audio) if v == "AUDIO" else v for k, v in inputs.items()}
    with Omni("voice_chat", **models) as omni:
        with pytest.raises(error) as raised:
            omni.submit(omni.request("", **inputs, **params))
        assert not omni.has_unfinished()
        for stage in omni.graph.stages.values():
            assert not stage.engine.has_unfinished()
    if field is not None:
        assert raised.value.field == field
