"""`ar_speech`: the AR stage answers and the voice speaks the answer piece by piece while it is written.

Streamed = chained: its text equals `ar_text`'s for the same request (greedy, token for token), and its audio equals
the voice synthesizing the same pieces one by one with the same seeds (within 1e-4, plus the 16-bit step), on the
tiny random weights and on the real SmolLM2 and Piper voice. The splitter's cuts are checked on their own."""

from __future__ import annotations

import wave

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from tts_tiny import make_tiny_voice

from omni_kernel.cli import main
from omni_kernel.core.errors import InputError
from omni_kernel.core.params import MAX_SEED
from omni_kernel.core.request import AUDIO, StageInput, StreamChunk
from omni_kernel.events import AudioDelta, RequestFinished, StageFinished, TokenDelta
from omni_speech.text_stream import FIRST_MIN_CHARS, MAX_CHARS, SentenceSplitter


def pieces_of(deltas: list[str]) -> list[str]:
    splitter = SentenceSplitter()
    pieces = [p.text for delta in deltas for p in splitter.feed(TokenDelta("r", "answer", delta))]
    return pieces + [p.text for p in splitter.end(None)]


# ---- where the pieces end ----------------------------------------------------------------------------------

def test_pieces_end_at_sentence_ends_and_the_first_sooner_at_a_clause():
    text = ("Sure, here is a list of the colours you asked about: red, orange and yellow. Green is next! "
            "Is blue last? No.\n\nIndigo and violet end it. Pi is 3.14 or so")
    assert pieces_of([text]) == [
        "Sure, here is a list of the colours you asked about:", " red, orange and yellow.", " Green is next!",
        " Is blue last?", " No.", "\n\nIndigo and violet end it.", " Pi is 3.14 or so"]


def test_a_short_first_clause_waits_and_a_sentence_waits_for_the_space_after_it():
    assert pieces_of(["Yes, it is. And"]) == ["Yes, it is.", " And"]  # "Yes," is shorter than FIRST_MIN_CHARS
    splitter = SentenceSplitter()
    assert splitter.feed(TokenDelta("r", "a", "It ends.")) == []  # "." may be a decimal point until a space
    assert [p.text for p in splitter.feed(TokenDelta("r", "a", " Then"))] == ["It ends."]
    assert len("Yes, it is") < FIRST_MIN_CHARS


def test_a_run_on_sentence_is_cut_after_its_last_space_within_the_limit():
    words = " ".join(f"word{i}" for i in range(120))
    pieces = pieces_of([words])
    assert len(pieces) > 1 and all(len(p) <= MAX_CHARS for p in pieces[:-1]) and "".join(pieces) == words
    assert all(p.endswith(" ") for p in pieces[:-1])


def test_blank_text_makes_no_piece():
    assert pieces_of(["  \n", " "]) == [] and pieces_of([]) == []


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.sampled_from(list("ab ,.!?\n:3")), max_size=400), data=st.data())
def test_the_pieces_join_to_the_text_and_do_not_depend_on_how_it_streamed(text, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    pieces = pieces_of(deltas)
    assert pieces == pieces_of([text])
    assert all(p.strip() for p in pieces)
    assert "".join(pieces) == text[:len("".join(pieces))] and not text[len("".join(pieces)):].strip()


# ---- the voice takes a streamed input ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_voice(tmp_path_factory):
    return make_tiny_voice(tmp_path_factory.mktemp("tiny_voice"))


def test_a_stream_with_nothing_to_speak_fails_at_its_last_chunk(tiny_voice):
    from omni_speech.tts_config import TTSParams
    from omni_speech.tts_engine import TTSInputs
    from omni_speech.tts_voice import Voice

    inputs = TTSInputs(Voice.read(tiny_voice))
    opening = StageInput("r", "", params=TTSParams(), stream=True)
    inputs.check(opening)  # no text yet: nothing to refuse
    item = inputs.process(opening)
    item = inputs.extend(item, StreamChunk("r", "speak", 0, "¡¿ "))
    assert item.processed.chunks == ()
    with pytest.raises(InputError, match="nothing the voice can speak"):
        inputs.extend(item, StreamChunk("r", "speak", 1, "", last=True))
    spoken = inputs.extend(item, StreamChunk("r", "speak", 1, "Hello there.", last=True))
    assert [c.text for c in spoken.processed.chunks] == ["Hello there."]


# ---- streamed = chained ------------------------------------------------------------------------------------

def reference_audio(voice_path, pieces: list[str], seed: int) -> list[tuple[str, np.ndarray]]:
    """The voice synthesizing the pieces one by one, each of its chunks alone, with the seeds a request's chunks
    get (tts_engine.Speech.chunk_seed): (what it says, waveform) per chunk."""
    from omni_speech.tts_engine import SEED_STRIDE
    from omni_speech.tts_model import Row, synthesize
    from omni_speech.tts_voice import Voice
    from omni_speech.vits_decoder import load_voice

    voice, model = Voice.read(voice_path), load_voice(voice_path)
    chunks = []
    for piece in pieces:
        chunks += voice.chunks(piece, first=not chunks) if piece.strip() else []
    out = []
    for k, chunk in enumerate(chunks):
        row = Row(chunk.ids, voice.noise_scale, voice.noise_w, voice.length_scale,
                  (seed * SEED_STRIDE + k) % (MAX_SEED + 1))
        out.append((chunk.text, synthesize(model, [row])[0].numpy()))
    return out


def assert_streamed_equals_chained(events, voice_path, seed: int, ar_result) -> list[str]:
    """The streamed answer's text and tokens are `ar_text`'s; its audio is the voice's on the same pieces."""
    result = next(e.result for e in events if isinstance(e, RequestFinished))
    answer, speech = result.outputs["answer"], result.outputs["speak"]
    assert answer.text == ar_result.text and answer.data["token_ids"] == ar_result.output.data["token_ids"]
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == answer.text
    pieces = pieces_of([e.text for e in events if isinstance(e, TokenDelta)])
    deltas = [e for e in events if isinstance(e, AudioDelta)]
    reference = reference_audio(voice_path, pieces, seed)
    assert [d.text for d in deltas] == [text for text, _ in reference]
    for delta, (_, waveform) in zip(deltas, reference):
        peak = float(np.max(np.abs(waveform)))
        streamed = np.frombuffer(delta.pcm, "<i2").astype(np.float64) / 32767 * peak
        assert streamed.shape == waveform.shape
        assert np.max(np.abs(streamed - waveform)) <= 1e-4 + peak / 32767  # one 16-bit step: to_pcm truncates
    assert speech.data[AUDIO].pcm == b"".join(d.pcm for d in deltas)
    assert result.finals == ("answer", "speak") and result.output is answer
    trace = result.trace
    assert trace["stream.answer.speak.chunks"] in (len(pieces), len(pieces) + 1)  # + an empty last one
    assert 0 < trace["stream.answer.speak.first_chunk_ms"] <= trace["tts.first_audio_ms"]
    assert trace["tts.first_audio_ms"] <= trace["request.elapsed_ms"] + 50  # arrival precedes the submit a little
    assert trace["tts.seed"] == seed and trace["ar.stop_reason"] in ("eos", "max_tokens")
    return pieces


def spoken_before_answered(events) -> bool:
    first_audio = next(i for i, e in enumerate(events) if isinstance(e, AudioDelta))
    answered = next(i for i, e in enumerate(events) if isinstance(e, StageFinished) and e.node_id == "answer")
    return first_audio < answered


@pytest.fixture(scope="module")
def tiny_ar():
    from omni_qwen.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def test_streamed_equals_chained_on_the_tiny_weights(tiny_ar, tiny_voice):
    from omni_kernel import Omni

    params = {"max_tokens": 160, "ignore_eos": True, "seed": 7}
    prompt = "Tell me about the sea."
    with Omni("ar_speech", ar_model=str(tiny_ar), tts_model=str(tiny_voice)) as omni:
        events = list(omni.generate_stream(prompt, **params))
    with Omni("ar_text", ar_model=str(tiny_ar)) as omni:
        ar_result = omni.generate(prompt, **params)
    pieces = assert_streamed_equals_chained(events, tiny_voice, 7, ar_result)
    assert len(pieces) >= 2  # the tiny model's noise has no sentence ends: cut at MAX_CHARS
    assert spoken_before_answered(events)


def test_closing_the_stream_mid_answer_frees_both_stages(tiny_ar, tiny_voice):
    from omni_kernel import Omni

    with Omni("ar_speech", ar_model=str(tiny_ar), tts_model=str(tiny_voice)) as omni:
        stream = omni.generate_stream("Tell me about the sea.", max_tokens=200, ignore_eos=True, seed=1)
        for event in stream:
            if isinstance(event, AudioDelta):
                break
        stream.close()
        assert not omni.has_unfinished()
        for stage in omni.graph.stages.values():
            assert not stage.engine.has_unfinished()


def test_the_real_answer_is_spoken_sentence_by_sentence_while_it_is_written(smollm2_dir, voice_dir):
    from omni_kernel import Omni

    prompt = "Write three short sentences about the sun."
    params = {"max_tokens": 120, "seed": 3}
    with Omni("ar_speech", ar_model=str(smollm2_dir), tts_model=str(voice_dir)) as omni:
        events = list(omni.generate_stream(prompt, **params))
    with Omni("ar_text", ar_model=str(smollm2_dir)) as omni:
        ar_result = omni.generate(prompt, **params)
    pieces = assert_streamed_equals_chained(events, voice_dir, 3, ar_result)
    assert len(pieces) >= 3, pieces  # a short first piece, then sentences
    assert spoken_before_answered(events)


# ---- omni run ----------------------------------------------------------------------------------------------

def test_omni_run_prints_the_answer_and_writes_the_audio(tiny_ar, tiny_voice, tmp_path):
    out = tmp_path / "answer.wav"
    result = CliRunner().invoke(main, ["run", "--pipeline", "ar_speech", "--prompt", "Say hello.", "--ar-model",
                                       str(tiny_ar), "--tts-model", str(tiny_voice), "--output", str(out), "--seed",
                                       "2", "--max-tokens", "24", "-o", "ignore_eos=true"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "tts.first_audio_ms" in result.output
    assert "stream.answer.speak.chunks" in result.output
    with wave.open(str(out)) as f:
        assert f.getnframes() > 0


@pytest.mark.parametrize("args, expected", [
    (["--voice", "nobody"], "invalid voice: 'nobody' is not a voice of this model"),
    (["-o", "speed=9"], "invalid speed"),
    (["-o", "response_format=mp3"], "'mp3' does not match the output"),
])
def test_the_voices_bad_input_is_refused_before_the_answer_in_one_line_exit_2(tiny_ar, tiny_voice, tmp_path, args,
                                                                               expected):
    result = CliRunner().invoke(main, ["run", "--pipeline", "ar_speech", "--prompt", "Hi.", "--ar-model",
                                       str(tiny_ar), "--tts-model", str(tiny_voice), "--output",
                                       str(tmp_path / "a.wav"), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.output
    assert list(tmp_path.iterdir()) == []
