"""The web page's speech panels in a real browser (headless Chromium, as test_page_browser.py) against a server
over the test speech plugin (speech_plugin.py): a text spoken and played as it arrives, a file transcribed, and a
recording made through the browser's own microphone path (Chromium's fake capture device fed a WAV) transcribed.
Screenshots go to build/test-artifacts/browser/."""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import re
import struct
import subprocess
import wave

import httpx
import pytest
from test_page_browser import ARTIFACTS, BROWSER_DIR, LAUNCH, launch

from serving import running, speech_weights

playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright is in omni-serve's test extras")
expect = playwright_sync.expect

pytestmark = [pytest.mark.browser, pytest.mark.server]

# Records what the speech status says as it changes: the test reads the record, never the clock.
WATCH_STATUS = """() => {
  const status = document.querySelector('.speech-status');
  window.seenStatus = [];
  new MutationObserver(() => window.seenStatus.push(status.textContent))
    .observe(status, {subtree: true, childList: true, characterData: true});
}"""
HEARD = r"I heard (\d+\.\d) seconds of sound\."


def tone_wav(path, seconds: float = 2.0, rate: int = 48000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(9000 * math.sin(2 * math.pi * 330 * i / rate)))
                               for i in range(int(seconds * rate))))


@pytest.fixture(scope="module")
def microphone(tmp_path_factory):
    path = tmp_path_factory.mktemp("microphone") / "tone.wav"
    tone_wav(path)
    return path


@pytest.fixture(scope="module")
def chromium():
    """Starts the browser (test_page_browser.py's) with a fake microphone that plays the WAV it is given, and no
    permission prompt."""
    if not (BROWSER_DIR / "node_modules" / "@sparticuz" / "chromium").is_dir():
        pytest.skip("no headless Chromium: `make browser` installs it (npm ci of @sparticuz/chromium)")
    found = json.loads(subprocess.run(["node", "-e", LAUNCH], cwd=BROWSER_DIR, check=True, capture_output=True,
                                      text=True, timeout=120).stdout)

    def start(microphone):
        args = [*found["args"], "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-audio-capture={microphone}", "--autoplay-policy=no-user-gesture-required"]
        return launch(driver, {**found, "args": args})

    with playwright_sync.sync_playwright() as driver:
        yield start


@contextlib.contextmanager
def opened(browser, url: str, name: str, pipelines: int):
    """A page of the server at `url`; at the end its screenshot, and no script error."""
    page = browser.new_page(viewport={"width": 1000, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    expect(page.get_by_label("Pipeline", exact=True).locator("option")).to_have_count(pipelines)
    try:
        yield page
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        browser.close()
    assert not errors, f"the page's script failed: {errors}"


@pytest.fixture
def page(chromium, microphone, request, server):
    with opened(chromium(microphone), server.url, request.node.name, 2) as page:
        yield page


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-audio-page")
    with running(["--pipeline", "fake_tts", "--pipeline", "fake_asr", "--output-dir", str(tmp / "out"),
                  "--shutdown-timeout", "5"], tmp / "server.log", plugins=("speech_plugin:SpeechPlugin",)) as proc:
        yield proc


def test_a_text_is_spoken_and_played_as_it_arrives(page):
    page.get_by_label("Pipeline", exact=True).select_option("fake_tts")
    expect(page.get_by_label("Voice", exact=True).locator("option")).to_have_count(2)
    expect(page.get_by_label("Voice", exact=True)).to_have_value("ana")
    page.evaluate(WATCH_STATUS)
    page.get_by_label("Text", exact=True).fill("First a quick one. Then this is said slowly. The end.")
    page.get_by_role("button", name="Speak", exact=True).click()
    expect(page.get_by_role("status", name="Speech status")).to_contain_text("spoken:", timeout=30_000)
    seen = page.evaluate("window.seenStatus")
    playing = [s for s in seen if s.startswith("playing")]
    assert len(set(playing)) >= 2, seen  # the sound grew, sentence by sentence, before the end
    audio = page.get_by_label("Spoken audio", exact=True)
    page.wait_for_function("a => a.readyState >= 1 && a.duration > 0", arg=audio.element_handle(), timeout=10_000)
    duration = page.evaluate("a => a.duration", audio.element_handle())
    said = float(seen[-1].split()[1])
    assert duration == pytest.approx(said, abs=0.05) and said > 0.5
    expect(page.get_by_role("alert")).to_have_text("")


def test_a_recording_through_the_microphone_is_transcribed(page, microphone):
    page.get_by_label("Pipeline", exact=True).select_option("fake_asr")
    page.get_by_role("button", name="Record", exact=True).click()
    expect(page.get_by_role("status", name="Recording status")).to_have_text("recording")
    page.wait_for_timeout(1500)
    page.get_by_role("button", name="Stop", exact=True).click()
    transcript = page.get_by_role("log", name="Transcript")
    expect(transcript).to_have_attribute("aria-busy", "false", timeout=30_000)
    expect(transcript).to_have_text(re.compile(HEARD), timeout=30_000)
    heard = float(transcript.text_content().split()[2])
    assert 0.8 <= heard <= 10, heard  # about the 1.5 s recorded, the fake microphone's tone decoded
    expect(page.get_by_role("alert")).to_have_text("")
    # and a file, uploaded
    page.get_by_label("Audio file", exact=True).set_input_files(str(microphone))
    page.get_by_role("button", name="Transcribe", exact=True).click()
    expect(transcript).to_have_text("I heard 2.0 seconds of sound.", timeout=30_000)


def test_a_file_that_is_not_audio_shows_the_apis_message(page, tmp_path):
    page.get_by_label("Pipeline", exact=True).select_option("fake_asr")
    junk = tmp_path / "notes.wav"
    junk.write_bytes(b"not a sound" * 50)
    page.get_by_label("Audio file", exact=True).set_input_files(str(junk))
    page.get_by_role("button", name="Transcribe", exact=True).click()
    expect(page.get_by_role("alert")).to_contain_text("invalid file: the file is not audio", timeout=30_000)


# The real speech weights: serving.speech_weights (the user's converted voice and Whisper, `make models`).
SENTENCE = "The quick brown fox jumps over the lazy dog."


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9']+", " ", text.lower()).split()


def words_matched(said: list[str], heard: list[str]) -> int:
    """How many of the said words the heard ones hold in order (the best alignment over any pass of the loop)."""
    return sum(block.size for block in difflib.SequenceMatcher(None, said, heard, autojunk=False).get_matching_blocks())


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    weights = pytest.importorskip("omni_speech.weights", reason="omni-speech is not installed")
    paths = {}
    for key, model in (("tts_model", weights.VOICE), ("asr_model", weights.WHISPER)):
        paths[key] = speech_weights(weights, model)
        if paths[key] is None:
            pytest.skip(f"the real {model.name} is not in omni's cache: `make models` fetches it")
    tmp = tmp_path_factory.mktemp("serve-audio-page-real")
    args = ["--pipeline", "tts", "--pipeline", "asr", *(a for k, p in paths.items() for a in ("-c", f"{k}={p}")),
            "--output-dir", str(tmp / "out"), "--shutdown-timeout", "5"]
    with running(args, tmp / "server.log") as proc:
        yield proc


@pytest.mark.real_model
def test_the_real_voice_plays_and_whisper_transcribes_it_through_the_microphone(chromium, real_server, tmp_path,
                                                                                 request):
    """The page speaks with the real voice; the fake microphone plays that voice's sound (then a second of
    silence, looped), the page records it and the real Whisper writes it down."""
    pcm = httpx.post(real_server.url + "/v1/audio/speech", timeout=120, json={
        "model": "tts", "voice": "alloy", "input": SENTENCE, "response_format": "pcm"}).content
    microphone = tmp_path / "speech.wav"
    with wave.open(str(microphone), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm + b"\0" * 48000)
    seconds = len(pcm) / 48000 + 1
    with opened(chromium(microphone), real_server.url, request.node.name, 2) as page:
        page.get_by_label("Pipeline", exact=True).select_option("tts")
        expect(page.get_by_label("Voice", exact=True)).to_have_value("joe")
        page.get_by_label("Text", exact=True).fill(SENTENCE)
        page.get_by_role("button", name="Speak", exact=True).click()
        expect(page.get_by_role("status", name="Speech status")).to_contain_text("spoken:", timeout=60_000)
        assert float(page.get_by_role("status", name="Speech status").text_content().split()[1]) > 1.5
        page.get_by_label("Pipeline", exact=True).select_option("asr")
        page.get_by_role("button", name="Record", exact=True).click()
        expect(page.get_by_role("status", name="Recording status")).to_have_text("recording")
        page.wait_for_timeout(int(2 * seconds * 1000))  # a whole pass of the sentence, wherever the loop began
        page.get_by_role("button", name="Stop", exact=True).click()
        transcript = page.get_by_role("log", name="Transcript")
        expect(transcript).to_contain_text(re.compile("lazy dog", re.I), timeout=60_000)
        expect(transcript).to_have_attribute("aria-busy", "false", timeout=60_000)
        heard = words(transcript.text_content())
        assert words_matched(words(SENTENCE), heard) >= len(words(SENTENCE)) - 1, (
            f"Whisper heard {' '.join(heard)!r} for {SENTENCE!r} (one word in nine may go astray on the way "
            "through the browser's recorder: tiny.en heard 'quit' for 'quick' on one CPU)")
        expect(page.get_by_role("alert")).to_have_text("")
