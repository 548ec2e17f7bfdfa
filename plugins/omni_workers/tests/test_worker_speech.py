"""`ar_speech` (omni_speech: the AR stage answers, the voice speaks the answer piece by piece while it is written)
with its stages in worker processes, on the tiny weights (the demo AR checkpoint, omni_speech's tiny voice): the
same answer, token for token, and the same sound, chunk by chunk, as in one process; an abort mid-stream frees
both workers; a killed voice worker fails only its request and comes back."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.events import AudioDelta, RequestFailed, RequestFinished
from omni_kernel.testing import drain, wait_until
from omni_workers.process_stage import ProcessStage

pytest.importorskip("omni_speech")
sys.path.insert(0, str(Path(__file__).parents[2] / "omni_speech" / "tests"))
from tts_tiny import make_tiny_voice  # noqa: E402

pytestmark = [pytest.mark.process]

PROMPT = "Tell me about the sea."
PARAMS = {"max_tokens": 160, "ignore_eos": True, "seed": 7}  # the tiny model's noise: cut at MAX_CHARS, twice


def tiny_weights(voice_dir: Path) -> dict:
    """The run settings of `ar_speech` on the tiny weights (the voice made in `voice_dir`)."""
    from omni_qwen.demo import ensure_demo_checkpoint

    return {"ar_model": str(ensure_demo_checkpoint()), "tts_model": str(make_tiny_voice(voice_dir))}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict:
    return tiny_weights(tmp_path_factory.mktemp("tiny_voice"))


def spoken(events) -> tuple:
    """The answer (text and tokens) and the sound as it streamed (each chunk's text and samples)."""
    np = pytest.importorskip("numpy")
    result = next(e.result for e in events if isinstance(e, RequestFinished))
    answer = result.outputs["answer"]
    chunks = [(e.text, np.frombuffer(e.pcm, "<i2").astype(np.int32)) for e in events if isinstance(e, AudioDelta)]
    return answer.text, answer.data["token_ids"], chunks, result.trace


def test_ar_speech_in_workers_answers_and_speaks_what_one_process_does(weights):
    with Omni("ar_speech", **weights) as inproc:
        text, tokens, chunks, _ = spoken(list(inproc.generate_stream(PROMPT, **PARAMS)))
    with Omni("ar_speech", placement="process", **weights) as placed:
        assert all(isinstance(s, ProcessStage) for s in placed.graph.stages.values())
        got_text, got_tokens, got_chunks, trace = spoken(list(placed.generate_stream(PROMPT, **PARAMS)))
    assert (got_text, got_tokens) == (text, tokens)
    assert [t for t, _ in got_chunks] == [t for t, _ in chunks] and len(chunks) >= 2
    for (_, got), (_, want) in zip(got_chunks, chunks):
        assert got.shape == want.shape and abs(got - want).max() <= 1  # one 16-bit step
    assert trace["stream.answer.speak.chunks"] >= 2


def freed(stage) -> bool:
    """The stage's worker holds nothing of any request (its scheduler counts none; an AR stage's KV blocks are
    free)."""
    stage.pump()
    stats = stage.stats()
    return stats.running == stats.waiting == 0 and stats.kv_blocks_used in (None, 0)


def until_spoken(o: Omni) -> list:
    """Step until the first sound came (the answer goes on): the events so far."""
    events: list = []
    drain(o, until=lambda: any(isinstance(e, AudioDelta) for e in events) or not o.has_unfinished(),
          on_step=events.extend)
    assert o.has_unfinished(), "the request ended before it was spoken"
    return events


def test_ar_speech_in_workers_abort_mid_stream_and_a_killed_voice_worker(weights):
    """Aborted once the first sound came: both workers free it. Then the voice's worker is killed mid-stream: that
    request fails naming the voice (the answer's worker frees it), and the voice comes back for the next."""
    long = {**PARAMS, "max_tokens": 400}
    with Omni("ar_speech", placement="process", **weights) as o:
        answer, speak = o.graph.stages["answer"], o.graph.stages["speak"]
        rid = o.submit(o.request(PROMPT, **long))
        until_spoken(o)
        o.abort(rid)
        assert [(e.request_id, e.kind) for e in drain(o) if isinstance(e, RequestFailed)] == [(rid, "aborted")]
        wait_until(lambda: freed(answer) and freed(speak), 60, "both workers to free the aborted request")
        assert answer.stats().kv_blocks_used == 0

        victim = o.submit(o.request(PROMPT, **long))
        events = until_spoken(o)
        first = speak.proc.pid
        os.kill(first, signal.SIGKILL)
        failed = [e for e in events + drain(o) if isinstance(e, RequestFailed)]
        assert [(e.request_id, e.node_id, e.kind) for e in failed] == [(victim, "speak", "runtime")]
        assert "SIGKILL" in failed[0].error and "restarted" in failed[0].error
        wait_until(lambda: freed(answer), 60, "the answer's worker to free the lost request")
        again = o.generate(PROMPT, **PARAMS)
        assert again.outputs["speak"].data is not None and speak.proc.pid != first
        assert speak.stats().placed.restarts == 1 and answer.stats().placed.restarts == 0
