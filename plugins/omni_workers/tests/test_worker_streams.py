"""Streaming edges and joins across the process boundary (placement `process`): the chunks of a streaming edge
reach a stage in a worker as they are cut, a join's merged input reaches its worker as one hand-off, and the
outputs, the failures and the aborts are those of one process. Torch-free: worker_fakes' `fake_spoken` (words ->
say, streamed) and `fake_narrated` (words -> render and -> say, joined by mux)."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from functools import partial
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.core.request import StageInput, StreamChunk
from omni_kernel.events import AudioDelta, RequestFailed, RequestFinished, StageFinished
from omni_kernel.testing import drain, wait_until

sys.path.insert(0, str(Path(__file__).parent))
from test_workers import alive  # noqa: E402
from worker_fakes import make_host  # noqa: E402

pytestmark = [pytest.mark.process]

PROMPTS = ["one two three", "a b c d e f g h", "single", "x y z x y z x y z"]


def outcome(events, request_ids) -> dict:
    """Per request: its final outputs (text, and the sound where there is one) and what `say` streamed, or how it
    failed (node, kind, error)."""
    spoken: dict[str, list] = {rid: [] for rid in request_ids}
    got = {}
    for event in events:
        if isinstance(event, AudioDelta):
            spoken[event.request_id].append((event.text, event.pcm))
        elif isinstance(event, RequestFinished):
            outputs = event.result.final_outputs
            got[event.request_id] = {node: (out.text, (out.data or {}).get("pcm")) for node, out in outputs.items()}
        elif isinstance(event, RequestFailed):
            got[event.request_id] = (event.node_id, event.kind, event.error)
    return {rid: (got[rid], spoken[rid]) for rid in request_ids}


def run_all(omni: Omni, prompts: list[str]) -> list:
    """Every prompt submitted at once, run to its end: each request's outcome, in order."""
    ids = [omni.submit(omni.request(p)) for p in prompts]
    done = outcome(drain(omni), ids)
    return [done[rid] for rid in ids]


def stats_of(stage):
    """The stage's stats once its worker has sent them after everything it was sent (pumped)."""
    stage.pump()
    return stage.stats()


def settled(stage) -> bool:
    """The stage's worker holds no request: its scheduler counts none, its runner keeps none."""
    stats = stats_of(stage)
    return stats.running == stats.waiting == 0 and stats.model.get("fake.live") == 0


def held_after_two_words(o: Omni, gate: Path) -> list:
    """Step until `say` has spoken two words and `words` is held on its gate's step: the events so far."""
    events: list = []

    def held() -> bool:
        events.extend(o.step())
        spoken = [e for e in events if isinstance(e, AudioDelta)]
        return len(spoken) == 2 and gate.with_suffix(".started").exists()

    wait_until(held, 30, "the first two words spoken and the words stage held on the gate")
    return events


@pytest.mark.parametrize("pipeline", ["fake_spoken", "fake_narrated"])
@pytest.mark.parametrize("placement", ["process", "say=process", "words=process"])
def test_streams_and_joins_in_workers_give_what_one_process_gives(pipeline, placement):
    """Every stage in a worker, or only the streaming edge's target, or only its source: the same outputs, the same
    sound chunk by chunk, for requests that run together; a join's merged input reaches its worker whole."""
    with Omni(pipeline, host=make_host()) as inproc:
        want = run_all(inproc, PROMPTS)
    with Omni(pipeline, host=make_host(), placement=placement) as placed:
        got = run_all(placed, PROMPTS)
        stages = placed.graph.stages
        assert [type(stages[n]).__name__ == "ProcessStage" for n in ("words", "say")] == [
            placement != "say=process", placement != "words=process"]
    assert got == want
    assert all(len(spoken) == len(prompt.split()) for (_, spoken), prompt in zip(got, PROMPTS))
    if pipeline == "fake_narrated":
        assert got[0][0]["mux"][0] == ("mux<join[video=fake_render_to_mux[rendered 3 words]|"
                                       "voice=fake_say_to_mux[ONE TWO THREE ]]>")


def test_the_target_worker_speaks_while_the_source_worker_still_writes(tmp_path):
    """Each chunk crosses to the `say` worker as it is cut: the words before the gate are spoken while `words` is
    held on the gate's step, and the rest follows once it opens."""
    gate = tmp_path / "gate"
    with Omni("fake_spoken", host=make_host(), placement="process") as o:
        rid = o.submit(o.request(f"one two gate={gate} three"))
        events = held_after_two_words(o, gate)
        assert not any(isinstance(e, StageFinished) for e in events)
        assert [e.text for e in events if isinstance(e, AudioDelta)] == ["one ", "two "]
        gate.touch()
        events += drain(o)
    result = next(e.result for e in events if isinstance(e, RequestFinished) and e.request_id == rid)
    assert result.outputs["say"].text == f"ONE TWO GATE={str(gate).upper()} THREE "
    assert result.trace["stream.words.say.chunks"] == 5  # four words and the empty last chunk
    assert result.trace["say.pid"] != result.trace["words.pid"] != os.getpid()


def test_an_abort_mid_stream_stops_both_workers_at_their_next_step_and_frees_them(tmp_path):
    """Aborted while `words` is held on its third step and `say` waits for its next chunk: `words` runs no step
    after the held one, `say` none after its two, and both workers free the request (their runners hold nothing,
    their schedulers count nothing); the next request is served."""
    gate = tmp_path / "gate"
    with Omni("fake_spoken", host=make_host(), placement="process") as o:
        rid = o.submit(o.request(f"one two gate={gate} three four five"))
        held_after_two_words(o, gate)
        words, say = o.graph.stages["words"], o.graph.stages["say"]
        o.abort(rid)
        gate.touch()
        events = drain(o)
        assert [(e.request_id, e.kind) for e in events if isinstance(e, RequestFailed)] == [(rid, "aborted")]
        assert not any(isinstance(e, AudioDelta) for e in events)
        wait_until(lambda: settled(words) and settled(say), 30, "both workers to free the aborted request")
        assert stats_of(words).model["fake.steps"] == 3 and stats_of(say).model["fake.steps"] == 2
        assert o.generate("after abort").outputs["say"].text == "AFTER ABORT "


@pytest.mark.parametrize("side", ["target", "source"])
def test_a_failure_on_either_side_ends_both_with_the_error_of_one_process(side):
    """A chunk `say` refuses (its input processor raises) fails the request as in one process, naming `say`, and
    `words` stops working on it; a `words` engine that dies fails it naming `words`, and `say` frees it."""
    prompt = "say boom now and more words here" if side == "target" else "explode now please and more"
    with Omni("fake_spoken", host=make_host()) as inproc:
        want = run_all(inproc, [prompt])
    with Omni("fake_spoken", host=make_host(sleep_ms=5), placement="process") as o:
        got = run_all(o, [prompt])
        words, say = o.graph.stages["words"], o.graph.stages["say"]
        wait_until(lambda: settled(say), 30, "say to free the failed request")
        if side == "target":
            wait_until(lambda: settled(words), 30, "words to free the failed request")
            assert stats_of(words).model["fake.steps"] < len(prompt.split())
    (failure, _), = got
    assert failure == want[0][0] and failure[:2] == (("say", "bad_input") if side == "target" else
                                                      ("words", "engine_dead"))


def test_a_killed_target_worker_fails_only_its_requests_and_comes_back(tmp_path):
    """`say`'s worker is killed mid-stream: its request fails naming `say`, the worker it shares nothing with
    (`words`, which also serves a `fake_slow` request of the same host) frees it and serves on, and `say` comes back
    in a new worker for the next request."""
    gate = tmp_path / "gate"
    host = make_host(shared=True)
    with Omni("fake_spoken", host=host, placement="process") as o, \
            Omni("fake_slow", host=host, placement="process") as other:
        words, say = o.graph.stages["words"], o.graph.stages["say"]
        assert other.graph.stages["words"].proc is words.proc  # one share key: one worker
        bystander = other.submit(other.request("not spoken at all"))  # in the words worker's batches
        victim = o.submit(o.request(f"one two gate={gate} three"))
        held_after_two_words(o, gate)
        first = say.proc.pid
        os.kill(first, signal.SIGKILL)
        failed = []
        wait_until(lambda: failed.extend(e for e in o.step() if isinstance(e, RequestFailed)) or failed, 30,
                   "the spoken request to fail")
        gate.touch()
        done = {e.request_id: e for e in drain(other) if isinstance(e, RequestFinished)}
        assert done[bystander].result.text == "rendered 4 words"
        (lost,) = failed
        assert lost.request_id == victim and lost.node_id == "say" and lost.kind == "runtime"
        assert "SIGKILL" in lost.error and "restarted" in lost.error
        wait_until(lambda: settled(words), 30, "words to free the lost request")
        again = o.generate("back again")
        assert again.outputs["say"].text == "BACK AGAIN " and again.trace["say.pid"] not in (first, os.getpid())
        assert say.stats().placed.restarts == 1 and words.stats().placed.restarts == 0
        assert not alive(first)


def test_replicated_target_each_request_streams_to_its_own_replica():
    """`replicas="say=2"`: each request's chunks go to the replica its hand-off went to; the outputs are one
    process's."""
    with Omni("fake_spoken", host=make_host()) as inproc:
        want = run_all(inproc, PROMPTS)
    with Omni("fake_spoken", host=make_host(sleep_ms=5), placement="process", replicas="say=2") as o:
        got = run_all(o, PROMPTS)
        pids = {r.proc.pid for r in o.graph.stages["say"].replicas}
        owners = {id(r) for r in o.graph.stages["say"].owner.values()}
    assert got == want and len(pids) == 2 and not owners


def test_a_ray_actor_puts_chunks_back_in_order():
    """Ray runs a threaded actor's calls in any order: chunks that come before the hand-off that opens their
    request, or before the chunk they follow, wait for their turn; those after an abort are dropped. The actor's
    body (ray_actor.StageActor) runs here without Ray."""
    from omni_kernel.core.graph import NodeSpec
    from omni_workers.messages import Abort, Append, HandOff, Sealed
    from omni_workers.ray_actor import StageActor
    from omni_workers.stage_host import WorkerSpec

    def sealed(value) -> Sealed:
        return Sealed(value.request_id, pickle.dumps(value))

    logger = logging.getLogger("omni")  # the actor sets up its process's logging: this one's is put back
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    spec = WorkerSpec(NodeSpec("say", "fake.say", policy={"sleep_ms": 0}), "say", None, partial(make_host))
    actor = StageActor(list(sys.path), pickle.dumps(spec))
    try:
        chunks = [StreamChunk("r", "say", i, text, last=i == 2) for i, text in enumerate(["one ", "two ", "three"])]
        for message in (Append(0, sealed(chunks[2])), Append(0, sealed(chunks[1])),
                        HandOff(0, sealed(StageInput("r", "", stream=True))), Append(0, sealed(chunks[0])),
                        Abort(0, "q"), Append(0, sealed(StreamChunk("q", "say", 0, "late "))),
                        HandOff(0, sealed(StageInput("q", "", stream=True)))):
            actor.handle(message)
        events = []

        def finished() -> bool:
            with actor.lock:
                out, actor.out = actor.out, []
            events.extend(pickle.loads(s.data) for message in out for s in message.events)
            return any(isinstance(e, StageFinished) for e in events)

        wait_until(finished, 30, "the streamed request to finish")
        assert [e.text for e in events if isinstance(e, AudioDelta)] == ["one ", "two ", "three"]
        assert {e.request_id for e in events} == {"r"}
        assert not actor.order.next and not actor.order.early and not actor.host.requests
    finally:
        actor.shutdown()
        logger.handlers[:] = handlers
        logger.propagate, logger.level = propagate, level
