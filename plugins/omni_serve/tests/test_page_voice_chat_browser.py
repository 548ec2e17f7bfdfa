"""The web page's spoken chats in a real browser (headless Chromium with a fake microphone, as
test_page_audio_browser.py) against a server over chat_speech_plugin.py: a chat on a pipeline that speaks plays
its answer's `delta.audio` as it streams, and the voice chat records the microphone, sends it as `input_audio` and
plays the answer. Screenshots go to build/test-artifacts/browser/."""

from __future__ import annotations

import re

import pytest
from test_page_audio_browser import WATCH_STATUS, chromium, microphone, opened  # noqa: F401 - fixtures

from serving import running

playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright is in omni-serve's test extras")
expect = playwright_sync.expect

pytestmark = [pytest.mark.browser, pytest.mark.server]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-voice-chat-page")
    with running(["--pipeline", "fake_ar_speech", "--pipeline", "fake_voice_chat", "--output-dir", str(tmp / "out"),
                  "--shutdown-timeout", "5"], tmp / "server.log",
                 plugins=("chat_speech_plugin:ChatSpeechPlugin",)) as proc:
        yield proc


@pytest.fixture
def page(chromium, microphone, request, server):  # noqa: F811 - the imported fixtures
    with opened(chromium(microphone), server.url, request.node.name, 2) as page:
        yield page


def spoken_seconds(page) -> float:
    """The spoken answer's length as the status says it, checked against the <audio> that holds it."""
    expect(page.get_by_role("status", name="Speech status")).to_contain_text("spoken:", timeout=60_000)
    said = float(page.get_by_role("status", name="Speech status").text_content().split()[1])
    audio = page.get_by_label("Spoken answer", exact=True)
    page.wait_for_function("a => a.readyState >= 1 && a.duration > 0", arg=audio.element_handle(), timeout=10_000)
    assert page.evaluate("a => a.duration", audio.element_handle()) == pytest.approx(said, abs=0.05)
    return said


def test_a_chat_that_speaks_plays_its_answer_as_it_streams(page):
    page.get_by_label("Pipeline", exact=True).select_option("fake_ar_speech")
    expect(page.locator("#pipeline-kind")).to_have_text("answers aloud in a chat")
    page.evaluate(WATCH_STATUS)
    page.get_by_label("Prompt", exact=True).fill("Tell me about the sea.")
    page.get_by_role("button", name="Send", exact=True).click()
    said = spoken_seconds(page)
    playing = [s for s in page.evaluate("window.seenStatus") if s.startswith("playing")]
    assert len(set(playing)) >= 2, playing  # the sound grew, piece by piece, before the end
    answer = page.locator(".message.assistant")
    expect(answer).to_have_count(1)
    assert said == pytest.approx(sum(int(22050 * 0.02 * len(p)) for p in pieces(answer.text_content())) / 22050,
                                 abs=0.05)
    expect(page.get_by_role("alert")).to_have_text("")


def pieces(text: str) -> list[str]:
    from omni_kernel.events import TokenDelta
    from omni_speech.text_stream import SentenceSplitter

    splitter = SentenceSplitter()
    return [p.text for p in splitter.feed(TokenDelta("r", "a", text))] + [p.text for p in splitter.end(None)]


def test_the_voice_chat_hears_the_microphone_and_answers_aloud(page):
    page.get_by_label("Pipeline", exact=True).select_option("fake_voice_chat")
    expect(page.locator("#pipeline-kind")).to_have_text("hears you and answers aloud")
    expect(page.get_by_label("Prompt", exact=True)).to_be_hidden()
    page.get_by_role("button", name="Record", exact=True).click()
    expect(page.get_by_role("status", name="Recording status")).to_have_text("recording")
    page.wait_for_timeout(1500)
    page.get_by_role("button", name="Stop", exact=True).click()
    question = page.locator(".message.user")
    expect(question).to_have_text(re.compile(r"\(spoken question, \d+\.\d s\)"), timeout=30_000)
    assert 0.8 <= float(question.text_content().split()[2]) <= 10
    assert spoken_seconds(page) > 0.2
    expect(page.locator(".message.assistant")).not_to_have_text("")
    expect(page.get_by_role("alert")).to_have_text("")
