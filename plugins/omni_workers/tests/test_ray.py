"""Placement `ray`: the fake pipeline's stages in Ray actors of a local Ray started here (loopback, 2 CPUs).

One module, one `ray.init`, bounded. Skipped, with the reason, where Ray is not installed (the kernel-only venv)
or cannot start on this machine; never a silent pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.core.errors import InvalidParameter, ModelError, StageUnavailable
from omni_kernel.events import RequestFailed, RequestFinished
from omni_kernel.testing import drain, wait_until

sys.path.insert(0, str(Path(__file__).parent))
from test_worker_streams import PROMPTS, held_after_two_words, settled, stats_of  # noqa: E402
from test_worker_streams import run_all as outcomes  # noqa: E402
from test_workers import retry, run_all, step_until_held, within  # noqa: E402
from worker_fakes import make_host  # noqa: E402

pytestmark = [pytest.mark.process]


@pytest.fixture(scope="module")
def ray():
    try:
        import ray
    except ImportError as exc:
        pytest.skip(f"Ray is not installed here ({exc}); `pip install 'omni-workers[ray]'` (make test does)")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"a local Ray could not start on this machine: {type(exc).__name__}: {exc}")
    yield ray
    ray.shutdown()


def test_ray_stages(ray):
    from omni_workers.ray_stage import RayStage

    with Omni("fake_slow", host=make_host(sleep_ms=5), placement="ray") as o:
        assert all(isinstance(s, RayStage) for s in o.graph.stages.values())
        done = run_all(o, [f"p{i} a b" for i in range(6)] + ["frames please"])
        assert all(isinstance(e, RequestFinished) for e in done.values()), done
        result = list(done.values())[-1].result
        assert result.output.data["frames"].sum() == sum(range(24))  # through the object store
        trace = result.trace
        assert len({trace["words.pid"], trace["render.pid"], trace["fake.connector_pid"]}) == 3

        with pytest.raises(InvalidParameter, match="contains bad"):
            o.submit(o.request("a bad one"))
        assert not o.has_unfinished()

        rid = o.submit(o.request("x " * 200))
        o.step()
        o.abort(rid)
        events = []
        while o.has_unfinished():
            events += o.step()
        assert events[-1].kind == "aborted"

        # an actor that dies fails its request, naming the stage, and is restarted
        (failed,) = run_all(o, ["crash here"]).values()
        assert isinstance(failed, RequestFailed) and failed.kind == "runtime"
        assert "stage 'words'" in failed.error and "restarted" in failed.error
        assert o.generate("after that").text == "rendered 2 words"


def test_ray_build_error_is_typed(ray):
    with pytest.raises(ModelError, match="fake model is missing"):
        Omni("fake_slow", host=make_host(), placement="words=ray", fake_fail_build=True)


def test_a_restarting_actor_stalls_no_step_and_fails_calls_at_once_when_told(ray, tmp_path):
    """The front's step does not wait for a restarted actor's build (a model load: here until the gate opens);
    built to fail fast (`fail_fast`) a submit needing it raises StageUnavailable at once; then it serves again."""
    gate = tmp_path / "gate"
    with Omni("fake_slow", host=make_host(), placement="ray", fake_build_gate=str(gate), fail_fast=True) as o:
        gate.touch()
        (failed,) = within(lambda: run_all(o, ["crash here"]), timeout=20).values()  # a hang: the step waited
        assert isinstance(failed, RequestFailed) and "restarted" in failed.error
        got = within(lambda: o.submit(o.request("during the restart")), timeout=10)
        assert isinstance(got, StageUnavailable) and "stage 'words'" in str(got) and "restarting" in str(got), got
        assert within(lambda: drain(o)) == []
        gate.unlink()
        assert within(lambda: retry(lambda: o.generate("after the restart").text)) == "rendered 3 words"


def test_what_cannot_cross_to_or_from_an_actor_fails_its_own_request(ray):
    """Inputs, outputs and answers that cannot be pickled on one side or unpickled on the other fail their own
    request, naming the stage, and the actors serve on; a processed input stays in its actor, so one the front
    could not take never crosses. Before, an output or a processed input that could not be pickled ended the
    actor's stream or call, which the front took for the actor's death (every request of the stage failed and it
    restarted, the old actor left running), and the others hung or raised out of the front's step."""
    cases = {"an unsendable_output please": "stage 'render': its output could not be sent to the front",
             "an unreadable_output please": "stage 'render': its output could not be read from its Ray actor",
             "an unsendable_handoff please": "stage 'render': its input could not be sent to its Ray actor",
             "an unreadable_handoff please": "stage 'render': its input could not be read by its Ray actor"}
    with Omni("fake_slow", host=make_host(), placement="ray") as o:
        for prompt in ("an unsendable_input please", "an unreadable_input please"):
            got = within(lambda prompt=prompt: o.generate(prompt).text, timeout=20)
            assert got == "rendered 3 words", (prompt, got)
        for prompt, says in cases.items():
            done = within(lambda prompt=prompt: run_all(o, [prompt, "a fine one"]), timeout=20)
            assert not isinstance(done, Exception), (prompt, done)
            bad, fine = done.values()
            assert isinstance(bad, RequestFailed) and bad.error.startswith(says), (prompt, bad)
            assert isinstance(fine, RequestFinished) and fine.result.text == "rendered 3 words"
        assert [s.stats().placed.restarts for s in o.graph.stages.values()] == [0, 0]
        assert within(lambda: o.generate("after all that").text) == "rendered 3 words"


def test_an_actor_answers_a_concurrent_submit_while_its_step_runs(ray, tmp_path):
    """As with a worker process: a submit to a stage whose inputs may be processed beside a step
    (`concurrent_inputs`, as Wan's) is answered on Ray's thread at once, not after the step running now."""
    import threading

    gate = tmp_path / "gate"
    with Omni("fake_video", host=make_host(), placement="ray") as o:
        held = o.submit(o.request(f"hold={gate} one"))
        step_until_held(o, gate, timeout=30)
        got: list = []
        caller = threading.Thread(target=lambda: got.append(o.submit(o.request("two words"))), daemon=True)
        caller.start()
        caller.join(10)
        assert not caller.is_alive() and not gate.exists(), "the submit waited for the step"
        gate.touch()
        done = {e.request_id: e.result.text for e in drain(o) if isinstance(e, RequestFinished)}
        assert done == {held: "rendered 2 words", got[0]: "rendered 2 words"}


def test_ray_replicas_split_a_burst_between_two_actors(ray):
    """`replicas="words=2"` under Ray: two actors of the words stage (a CPU each of the two this Ray has; render
    stays here), each request to the less loaded one."""
    from omni_workers.ray_stage import RayStage
    from omni_workers.replicas import ReplicaStage

    with Omni("fake_slow", host=make_host(sleep_ms=5), placement="words=ray", replicas="words=2") as o:
        words = o.graph.stages["words"]
        assert isinstance(words, ReplicaStage) and all(isinstance(r, RayStage) for r in words.replicas)
        prompts = [" ".join([f"p{i}"] + ["w"] * (20 + i)) for i in range(6)]
        ids = [o.submit(o.request(p)) for p in prompts]
        assert sorted(sum(words.owner.get(rid) is r for rid in ids) for r in words.replicas) == [3, 3]
        done = {e.request_id: e for e in drain(o) if isinstance(e, (RequestFinished, RequestFailed))}
        pids = {done[rid].result.trace["words.pid"] for rid in ids}
        assert len(pids) == 2
        for rid, prompt in zip(ids, prompts):
            assert done[rid].result.text == f"rendered {len(prompt.split())} words", done[rid]


def test_ray_streams_and_joins_give_what_one_process_gives(ray, tmp_path):
    """`fake_narrated` with every stage in an actor (a quarter CPU each: the four fit this Ray's two): the outputs of
    one process, the streamed edge's chunks crossing to the `say` actor while `words` still writes (held on its
    gate's step), and an abort mid-stream that ends the request in both actors."""
    from omni_workers.ray_stage import RayStage

    with Omni("fake_narrated", host=make_host()) as inproc:
        want = outcomes(inproc, PROMPTS)
    gate = tmp_path / "gate"
    with Omni("fake_narrated", host=make_host(), placement="ray", ray_resources="CPU:0.25") as o:
        assert all(isinstance(s, RayStage) for s in o.graph.stages.values())
        assert within(lambda: outcomes(o, PROMPTS), timeout=60) == want
        rid = o.submit(o.request(f"one two gate={gate} three four"))
        held_after_two_words(o, gate)
        o.abort(rid)
        gate.touch()
        assert [e.kind for e in within(lambda: drain(o)) if isinstance(e, RequestFailed)] == ["aborted"]
        words, say = o.graph.stages["words"], o.graph.stages["say"]
        wait_until(lambda: settled(words) and settled(say), 30, "both actors to free the aborted request")
        assert stats_of(say).model["fake.steps"] == sum(len(p.split()) for p in PROMPTS) + 2


def test_ray_ar_speech_answers_and_speaks_what_one_process_does(ray, tmp_path):
    """`ar_speech` (omni_speech) with both stages in actors, on the tiny weights: the answer token for token and
    the sound chunk by chunk as in one process (one torch thread on each side: a sum's order follows the threads)."""
    torch = pytest.importorskip("torch")
    from test_worker_speech import PARAMS, PROMPT, spoken, tiny_weights

    weights = tiny_weights(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Omni("ar_speech", **weights) as inproc:
            text, tokens, chunks, _ = spoken(list(inproc.generate_stream(PROMPT, **PARAMS)))
    finally:
        torch.set_num_threads(threads)
    with Omni("ar_speech", placement="ray", worker_threads=1, ray_resources="CPU:0.5", **weights) as o:
        got = within(lambda: spoken(list(o.generate_stream(PROMPT, **PARAMS))), timeout=300)
    assert not isinstance(got, Exception), got
    got_text, got_tokens, got_chunks, trace = got
    assert (got_text, got_tokens) == (text, tokens) and trace["stream.answer.speak.chunks"] >= 2
    assert [t for t, _ in got_chunks] == [t for t, _ in chunks] and len(chunks) >= 2
    for (_, got), (_, want) in zip(got_chunks, chunks):
        assert got.shape == want.shape and abs(got - want).max() <= 1  # one 16-bit step
