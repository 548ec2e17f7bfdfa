"""The tts.vits stage on a tiny random VitsModel: a batch equals its rows alone, noise 0 equals transformers' own
VitsModel forward, the same seed gives the same audio alone or among other requests, one AudioDelta per sentence,
then the Audio, usage and trace."""

from __future__ import annotations

import pytest
from tts_tiny import SAMPLE_RATE, make_tiny_voice

from omni_kernel.core.events import AudioDelta, RequestFinished
from omni_kernel.core.request import AUDIO

TEXT = "Hello world. This is a test, is it not? Yes!"


@pytest.fixture(scope="module")
def tiny_voice(tmp_path_factory):
    return make_tiny_voice(tmp_path_factory.mktemp("tiny_voice"))


@pytest.fixture(scope="module")
def model(tiny_voice):
    from omni_speech.vits_decoder import load_voice

    return load_voice(tiny_voice)


@pytest.fixture(scope="module")
def omni(tiny_voice):
    from omni_kernel import Omni

    with Omni("tts", tts_model=str(tiny_voice)) as omni:
        yield omni


@pytest.mark.parametrize("batch_decoder", [True, False], ids=["batched_decoder", "decoder_by_row"])
def test_a_batch_equals_each_row_alone(model, batch_decoder):
    import torch

    from omni_speech.tts_model import Row, synthesize

    rows = [Row([1, 0, 20, 0, 30, 0, 40, 0, 2], 0.667, 0.8, 1.0, 11), Row([1, 0, 25, 0, 2], 0.5, 0.6, 1.3, 12),
            Row(list(range(1, 40)), 0.667, 0.8, 0.7, 13)]
    batch = synthesize(model, rows, batch_decoder)
    for row, waveform in zip(rows, batch):
        alone = synthesize(model, [row])[0]
        assert waveform.shape == alone.shape
        assert torch.allclose(waveform, alone, atol=1e-4, rtol=0)
    other_seed = synthesize(model, [Row(rows[0].ids, 0.667, 0.8, 1.0, 99)])[0]
    assert other_seed.shape != batch[0].shape or not torch.allclose(other_seed, batch[0])


def test_the_real_voice_batched_equals_each_sentence_alone(voice_dir):
    import torch

    from omni_speech.tts_model import Row, synthesize
    from omni_speech.tts_voice import Voice
    from omni_speech.vits_decoder import load_voice

    voice, model = Voice.read(voice_dir), load_voice(voice_dir)
    rows = [Row(voice.chunks(text)[0].ids, 0.667, 0.8, 1.0, seed)
            for seed, text in enumerate(["Knowledge is power.", "Where is the nearest train station?"])]
    for row, waveform in zip(rows, synthesize(model, rows, batch_decoder=True)):
        assert torch.allclose(waveform, synthesize(model, [row])[0], atol=1e-4, rtol=0)


def test_noise_zero_equals_transformers_vits_forward(model):
    import torch

    from omni_speech.tts_model import Row, synthesize

    ids = list(range(1, 40))
    saved = model.noise_scale, model.noise_scale_duration, model.speaking_rate
    model.noise_scale, model.noise_scale_duration, model.speaking_rate = 0.0, 0.0, 1 / 0.7
    try:
        with torch.inference_mode():
            reference = model(torch.tensor([ids])).waveform[0]
    finally:
        model.noise_scale, model.noise_scale_duration, model.speaking_rate = saved
    mine = synthesize(model, [Row(ids, 0.0, 0.0, 0.7, 5)])[0]
    assert mine.shape == reference.shape
    assert torch.allclose(mine, reference, atol=1e-4, rtol=0)


def test_one_audio_delta_per_sentence_then_the_audio_usage_and_trace(omni):
    events = list(omni.generate_stream(TEXT, seed=7))
    deltas = [e for e in events if isinstance(e, AudioDelta)]
    assert [d.text for d in deltas] == ["Hello world.", "This is a test, is it not?", "Yes!"]
    assert all(d.sample_rate == SAMPLE_RATE and d.pcm for d in deltas)
    result = events[-1].result
    audio = result.output.data[AUDIO]
    assert audio.pcm == b"".join(d.pcm for d in deltas) and audio.sample_rate == SAMPLE_RATE
    assert result.output.usage.audio_seconds == pytest.approx(audio.seconds)
    trace = result.trace
    assert trace["tts.sentences"] == 3 and trace["tts.input_chars"] == len(TEXT) and trace["tts.seed"] == 7
    assert trace["tts.audio_seconds"] == pytest.approx(audio.seconds, abs=1e-3)
    assert trace["tts.ttfa_ms"] > 0 and trace["tts.rtf"] > 0 and trace["tts.batch_max"] == 1
    assert result.path is None


def test_the_same_seed_gives_the_same_audio_alone_or_batched_with_others(omni):
    alone = omni.generate(TEXT, seed=3).output.data[AUDIO].pcm
    assert omni.generate(TEXT, seed=3).output.data[AUDIO].pcm == alone
    assert omni.generate(TEXT, seed=4).output.data[AUDIO].pcm != alone
    requests = [omni.request(TEXT, seed=3), omni.request("Another one. And a second sentence.", seed=1),
                omni.request("Short.", seed=2, speed=1.5)]
    results = {e.request_id: e.result for e in omni.run(requests) if isinstance(e, RequestFinished)}
    together = results[requests[0].request_id]
    assert together.trace["tts.batch_max"] == 3  # the three requests' sentences shared forwards
    # PCM is the waveform scaled to its peak and truncated to 16 bits: allow one step of rounding
    import numpy as np

    a = np.frombuffer(together.output.data[AUDIO].pcm, "<i2").astype(int)
    b = np.frombuffer(alone, "<i2").astype(int)
    assert a.shape == b.shape and np.abs(a - b).max() <= 4


def test_noise_zero_is_deterministic_without_a_seed(omni):
    first = omni.generate("Same every time.", noise_scale=0.0, noise_w=0.0).output.data[AUDIO].pcm
    assert omni.generate("Same every time.", noise_scale=0.0, noise_w=0.0).output.data[AUDIO].pcm == first


def test_the_output_file_is_written_in_its_extensions_format(omni, tmp_path):
    path = tmp_path / "speech.flac"
    result = omni.generate("Write me.", output=str(path), seed=1)
    assert result.path == str(path) and path.read_bytes()[:4] == b"fLaC"
    assert result.trace["tts.format"] == "flac"


def test_the_audio_streams_encoded_as_it_comes(omni):
    from omni_speech.audio_out import encoded_stream

    blocks = list(encoded_stream(omni.generate_stream(TEXT, seed=2), "wav"))
    assert blocks[0].startswith(b"RIFF") and len(blocks) >= 3  # the header with the first sentence, then one each
    pcm = omni.generate(TEXT, seed=2).output.data[AUDIO].pcm
    assert b"".join(blocks)[44:] == pcm


def test_a_vits_directory_without_a_voice_file_speaks_through_its_own_tokenizer(tmp_path):
    """An MMS-TTS-like directory: its VitsTokenizer makes the ids; its voice is named after the directory."""
    import json

    from transformers import VitsTokenizer

    from omni_kernel import Omni

    path = make_tiny_voice(tmp_path / "mms_like")
    (path / "omni_voice.json").unlink()
    (tmp_path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate("_ abcdefghijklmnopqrstuvwxyz'.,?!")}))
    VitsTokenizer(str(tmp_path / "vocab.json"), pad_token="_", add_blank=True, phonemize=False).save_pretrained(path)
    with Omni("tts", tts_model=str(path)) as omni:
        events = list(omni.generate_stream("Hello world. Second one!", seed=1, voice="mms_like"))
    assert [e.text for e in events if isinstance(e, AudioDelta)] == ["Hello world.", "Second one!"]
    assert events[-1].result.trace["tts.voice"] == "mms_like"


def test_a_request_that_arrives_later_speaks_its_first_sentence_before_the_others_go_on(tiny_voice):
    from omni_kernel import Omni

    with Omni("tts", tts_model=str(tiny_voice), tts_max_batch=2) as omni:
        requests = [omni.request("One. Two. Three.", seed=i) for i in range(3)]
        order = [(e.request_id, e.text) for e in omni.run(requests) if isinstance(e, AudioDelta)]
    late = requests[2].request_id
    assert order.index((late, "One.")) < order.index((requests[0].request_id, "Two."))
    assert sorted(order) == sorted((r.request_id, t) for r in requests for t in ("One.", "Two.", "Three."))
