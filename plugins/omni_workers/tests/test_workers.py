"""Stage workers (placement `process`): the proxy keeps the Stage contract, stages overlap, faults stay in their
stage, and no worker outlives the front. Torch-free: the echo pipeline and the fake plugin of worker_fakes."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_kernel import Omni
from omni_kernel.cli import main
from omni_kernel.core.errors import EngineDead, InvalidParameter, ModelError, PluginError, UserError
from omni_kernel.core.placement import parse_placement
from omni_kernel.events import RequestFailed, RequestFinished, StageFailed, TokenDelta
from omni_kernel.testing import drain, wait_until
from omni_workers.cores import host_cores
from omni_workers.messages import Sealed
from omni_workers.process_stage import ProcessStage
from omni_workers.settings import WorkersSettings

sys.path.insert(0, str(Path(__file__).parent))
from worker_fakes import make_host  # noqa: E402

pytestmark = [pytest.mark.process]

HERE = Path(__file__).parent


def run_all(omni, prompts, **params) -> dict:
    """Submit every prompt and step until done: {request id: its RequestFinished or RequestFailed}, in order."""
    ids = [omni.submit(omni.request(p, **params)) for p in prompts]
    done = {e.request_id: e for e in drain(omni) if isinstance(e, (RequestFinished, RequestFailed))}
    return {rid: done[rid] for rid in ids}


def step_until_held(o, gate: Path, timeout: float = 60) -> list:
    """Step until a "hold=GATE" request's render step has started (it then waits until `gate` exists); returns
    the events of the steps taken meanwhile."""
    events = []

    def started() -> bool:
        events.extend(o.step())
        return gate.with_suffix(".started").exists()

    wait_until(started, timeout, f"the held render step to start ({gate.with_suffix('.started')})")
    return events


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_echo_in_a_worker_streams_what_inproc_streams():
    with Omni("echo", placement="process") as remote:
        assert isinstance(remote.graph.stages["echo"], ProcessStage)
        got = [e for e in remote.generate_stream("one two three", stream=True)]
    want = list(Omni("echo").generate_stream("one two three", stream=True))
    assert [e.text for e in got if isinstance(e, TokenDelta)] == [e.text for e in want if isinstance(e, TokenDelta)]
    assert got[-1].result.text == want[-1].result.text == "one two three"


def test_each_stage_runs_in_its_own_process_and_many_requests_finish():
    with Omni("fake_slow", host=make_host()) as inproc, Omni("fake_slow", host=make_host(), placement="process") as o:
        prompts = [f"p{i} " + "w " * (i % 4) for i in range(12)]
        done = run_all(o, prompts)
        assert all(isinstance(e, RequestFinished) for e in done.values())
        trace = next(iter(done.values())).result.trace
        pids = {trace["words.pid"], trace["render.pid"], trace["fake.connector_pid"]}
        assert len(pids) == 3 and trace["fake.connector_pid"] == os.getpid()
        want = run_all(inproc, prompts)
        assert sorted(e.result.text for e in done.values()) == sorted(e.result.text for e in want.values())


def test_a_requests_audio_reaches_a_stage_in_a_worker(tmp_path):
    """The audio input (an upload's bytes, or a path) crosses to the worker with the stage's input."""
    data = bytes(range(256)) * 64
    path = tmp_path / "a.wav"
    path.write_bytes(data[:1000])
    with Omni("fake_listen", host=make_host(), placement="process") as o:
        sizes = [o.generate(audio=audio).text.split()[:2] for audio in (data, str(path))]
        pid = int(o.generate(audio=data).text.split()[2])
    assert sizes == [[str(len(data)), hashlib.sha256(data).hexdigest()[:8]],
                     ["1000", hashlib.sha256(data[:1000]).hexdigest()[:8]]]
    assert pid != os.getpid()


def test_stages_overlap_and_the_front_does_not_spin():
    # a video-like job (1 word, 10 render steps) and a chat-like one (20 words, 1 render step), 50 ms a step
    def both(omni):
        jobs = [omni.request("v", fake_steps=10), omni.request("w " * 19 + "w", fake_steps=1)]
        for job in jobs:
            omni.submit(job)
        while omni.has_unfinished():
            omni.step()

    with Omni("fake_slow", host=make_host(sleep_ms=50)) as inproc:
        start = time.perf_counter()
        both(inproc)
        t_inproc = time.perf_counter() - start
    with Omni("fake_slow", host=make_host(sleep_ms=50), placement="process") as remote:
        run_all(remote, ["warm"])
        start, cpu = time.perf_counter(), time.process_time()
        both(remote)
        t_remote, cpu_remote = time.perf_counter() - start, time.process_time() - cpu
    # in-process each front step runs a words step then a render step; in workers they run at the same time
    assert t_remote < 0.8 * t_inproc, (t_remote, t_inproc)
    assert cpu_remote < 0.25 * t_remote, (cpu_remote, t_remote)  # the front blocks on the pipes


@pytest.fixture(scope="module")
def fake_slow_workers():
    """One `fake_slow` pipeline in worker processes for the tests that only submit and read: none of them kills,
    crashes or closes its workers, and each leaves nothing in flight. A test that does any of that, or asserts on
    what close() leaves, builds its own."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        yield o


def test_input_errors_stay_synchronous_and_typed(fake_slow_workers):
    o = fake_slow_workers
    with pytest.raises(InvalidParameter) as info:
        o.submit(o.request("a bad prompt"))
    assert info.value.field == "prompt" and "contains bad" in str(info.value)
    assert not o.has_unfinished()
    assert o.generate("fine now").text == "rendered 2 words"


def test_check_is_answered_while_a_downstream_step_runs(fake_slow_workers, tmp_path):
    """A submit calls the downstream stage's `check`: the worker answers it beside the step it is running, so a
    submit does not wait for a long denoise step (here a render step held until the test opens its gate)."""
    gate = tmp_path / "gate"
    o = fake_slow_workers
    held = o.submit(o.request(f"hold={gate} a"))
    events = step_until_held(o, gate)
    submitted = []
    thread = threading.Thread(target=lambda: submitted.append(o.submit(o.request("next one please"))))
    thread.start()
    thread.join(30)
    answered, still_held = bool(submitted), not gate.exists()
    gate.touch()
    thread.join()
    assert answered and still_held  # the submit came back while the render step was still held
    events += drain(o)
    finished = {e.request_id for e in events if isinstance(e, RequestFinished)}
    assert finished == {held, submitted[0]}


def test_abort_reaches_the_worker():
    with Omni("fake_slow", host=make_host(sleep_ms=20), placement="process") as o:
        rid = o.submit(o.request("x " * 30))
        o.step()
        o.abort(rid)
        events = []
        while o.has_unfinished():
            events += o.step()
        assert [type(e).__name__ for e in events if e.request_id == rid][-1] == "RequestFailed"
        assert events[-1].kind == "aborted"
        assert not o.graph.stages["words"].has_unfinished()
        assert o.generate("after abort").text == "rendered 2 words"


def test_a_killed_worker_fails_its_requests_once_and_is_restarted():
    with Omni("fake_slow", host=make_host(sleep_ms=20), placement="process") as o:
        words = o.graph.stages["words"]
        first_pid = words.proc.pid
        ok = o.submit(o.request("render this one please"))  # reaches the render worker, which lives on
        victim = o.submit(o.request("a b c d e f g h i j k l"))
        while ok not in o.graph.stages["render"].request_ids():
            o.step()
        os.kill(first_pid, signal.SIGKILL)
        done = {}
        while o.has_unfinished():
            done.update({e.request_id: e for e in o.step() if isinstance(e, (RequestFinished, RequestFailed))})
        failed = done[victim]
        assert isinstance(failed, RequestFailed) and failed.kind == "runtime" and failed.node_id == "words"
        assert "stage 'words'" in failed.error and "SIGKILL" in failed.error and "restarted" in failed.error
        assert isinstance(done[ok], RequestFinished)
        assert words.proc.pid != first_pid and o.generate("back again").text == "rendered 2 words"
        assert not alive(first_pid)


def test_a_crash_inside_a_step_fails_that_request_then_no_restart_left_means_engine_dead():
    with Omni("fake_slow", host=make_host(), placement="process", max_restarts=0) as o:
        done = run_all(o, ["crash now"])
        (failed,) = done.values()
        assert failed.kind == "runtime" and "stage 'words'" in failed.error and "not restarted" in failed.error
        with pytest.raises(EngineDead, match="stage 'words'"):  # an entry stage refuses at submit
            o.submit(o.request("hello"))
        assert not o.has_unfinished()


def test_a_worker_that_cannot_build_raises_typed_and_leaves_nothing():
    with pytest.raises(ModelError, match="fake model is missing"):
        Omni("fake_slow", host=make_host(), placement="process", fake_fail_build=True)


def test_numpy_outputs_cross_from_the_worker():
    np = pytest.importorskip("numpy")
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        result = o.generate("frames please")
        assert isinstance(result.output.data["frames"], np.ndarray)
        assert result.output.data["frames"].sum() == sum(range(24))


def test_placement_settings():
    assert parse_placement("process") == ("process", {})
    assert parse_placement("inproc,render=process") == ("inproc", {"render": "process"})
    assert parse_placement({"words": "ray"}) == (None, {"words": "ray"})
    with pytest.raises(InvalidParameter, match="placement"):
        parse_placement("g p u")
    with pytest.raises(UserError, match="placement 'gpu' is not installed; installed placements: inproc, process, ray"):
        Omni("fake_slow", host=make_host(), placement="gpu")
    with pytest.raises(InvalidParameter, match="no node 'nope'"):
        Omni("fake_slow", host=make_host(), placement="nope=process")
    with pytest.raises(InvalidParameter, match="max_restarts"):
        WorkersSettings(max_restarts=-1)
    for good in (None, 1, 4, "shared", "2"):
        WorkersSettings(worker_threads=good)
    for bad in (0, -1, True, "all"):
        with pytest.raises(InvalidParameter, match="is not an integer >= 1 or 'shared'"):
            WorkersSettings(worker_threads=bad)
    # the plan's placement applies when the run says nothing; the run wins when it does
    with Omni("fake_slow", host=make_host(words_placement="process")) as o:
        assert isinstance(o.graph.stages["words"], ProcessStage)
        assert not isinstance(o.graph.stages["render"], ProcessStage)
    with Omni("fake_slow", host=make_host(words_placement="process"), placement="inproc") as o:
        assert not any(isinstance(s, ProcessStage) for s in o.graph.stages.values())


def test_cli_placement_flag():
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "hi there", "--placement",
                                       "process"], obj={"host": make_host()})
    assert result.exit_code == 0, result.output
    assert "hi there" in result.output
    bad = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "hi", "--placement", "gpu"],
                             obj={"host": make_host()})
    assert bad.exit_code == 2 and "gpu" in bad.output


def test_cli_worker_threads_and_max_restarts_flags():
    def run(*args):
        return CliRunner().invoke(main, ["run", "--pipeline", "fake_slow", "--placement", "process", *args],
                                  obj={"host": make_host()})

    for threads, expected in (("1", 1), ("shared", host_cores())):  # each stage works alone here
        result = run("--prompt", "one two three", "--worker-threads", threads, "--json")
        assert result.exit_code == 0, result.output
        trace = json.loads(result.output.strip().splitlines()[-1])["trace"]
        assert trace["words.threads"] == [expected] * 3 and trace["render.threads"] == [expected] * 3
    crashed = run("--prompt", "crash now", "--max-restarts", "0")
    assert crashed.exit_code != 0 and "not restarted" in crashed.output
    restarted = run("--prompt", "crash now")  # the default: one restart
    assert restarted.exit_code != 0 and "restarted" in restarted.output and "not restarted" not in restarted.output
    for flag, value, says in (("--worker-threads", "many", "'many' is not an integer >= 1 or 'shared'"),
                              ("--worker-threads", "0", "is not an integer >= 1"),
                              ("--max-restarts", "-1", "invalid max_restarts: -1 is not an integer >= 0")):
        bad = run("--prompt", "hi", flag, value)
        assert bad.exit_code == 2 and says in bad.output and len(bad.output.strip().splitlines()) == 1


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    from worker_fakes import make_host
    from omni_kernel import Omni
    o = Omni("fake_slow", host=make_host(sleep_ms=20), placement="process")
    print(" ".join(str(s.proc.pid) for s in o.graph.stages.values()), flush=True)
    o.submit(o.request("x " * 2000))
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(0)  # no close(): the atexit hook stops the workers
    while not o.step():  # until the first event: the workers are serving the request
        pass
    print("serving", flush=True)
    while True:
        o.step()
""")


@pytest.mark.parametrize("how", ["exit", "sigterm", "sigkill"])
def test_no_worker_outlives_the_front(tmp_path, how):
    script = tmp_path / "front.py"
    script.write_text(ORPHAN_SCRIPT.format(here=str(HERE)))
    front = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        pids = [int(p) for p in front.stdout.readline().split()]
        assert len(pids) == 2, front.stderr.read()
        assert all(alive(p) for p in pids)
        if how != "exit":
            assert front.stdout.readline().strip() == "serving", front.stderr.read()
            front.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        front.wait(20)
        wait_until(lambda: not any(alive(p) for p in pids), 10, f"the workers to exit after the front's {how}")
    finally:
        if front.poll() is None:
            front.kill()
        front.wait()


def test_worker_load_lines_are_printed_once_with_the_stage_prefix(tmp_path):
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from worker_fakes import make_host
        from omni_kernel import Omni
        from omni_kernel.cli import _setup_logging
        _setup_logging()
        with Omni("fake_slow", host=make_host(), placement="process") as o:
            print(o.generate("hello world").text)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "rendered 2 words"
    assert out.stderr.count("omni[words]: loading the fake words model") == 1
    assert out.stderr.count("omni[render]: loading the fake render model") == 1


def test_plan_with_an_unknown_placement_is_a_plugin_error():
    from omni_kernel.core.graph import NodeSpec, PipelinePlan
    from omni_kernel.core.placement import RunSettings, check_placements

    plan = PipelinePlan("p", [NodeSpec("a", "t", final=True, placement="gpu")])
    with pytest.raises(PluginError, match="placement 'gpu'"):
        check_placements(RunSettings(), plan, {})


def test_workers_built_from_a_thread_outlive_that_thread():

    built = []
    thread = threading.Thread(target=lambda: built.append(Omni("fake_slow", host=make_host(), placement="process")))
    thread.start()
    thread.join(60)
    (omni,) = built
    with omni:
        # A window for the bug this guards against: PR_SET_PDEATHSIG would have fired when the thread ended, and
        # the kill takes a moment to land. Nothing to wait for when the workers (rightly) stay.
        time.sleep(0.3)
        assert omni.generate("still here").text == "rendered 2 words"


def test_shared_cores_the_only_busy_worker_steps_with_every_core(tmp_path):
    """worker_threads="shared": a worker whose stage is the only one with work steps with every core; while the
    other worker is busy too, with half. Each fake stage's trace says what its worker set for each step."""
    from omni_workers.cores import board, host_cores

    alone, both = host_cores(), max(1, host_cores() // 2)
    gate = tmp_path / "gate"
    free = len(board().free)
    with Omni("fake_slow", host=make_host(sleep_ms=5), placement="process", worker_threads="shared") as o:
        first = o.submit(o.request(f"hold={gate} a", fake_steps=2))  # words alone, then render alone (held)
        events = step_until_held(o, gate)
        second = o.submit(o.request("w " * 9 + "w"))  # words, while render's held step runs
        drain(o, on_step=events.extend,
              until=lambda: sum(isinstance(e, TokenDelta) and e.request_id == second for e in events) >= 10)
        gate.touch()  # words has finished: render is alone again
        events += drain(o)
        assert len(board().free) == free - 2
    assert len(board().free) == free  # the slots come back at close
    done = {e.request_id: e.result.trace for e in events if isinstance(e, RequestFinished)}
    assert done[first]["words.threads"] == [alone, alone]
    assert done[first]["render.threads"] == [alone, alone]
    assert done[second]["words.threads"] == [both] * 10
    assert done[second]["render.threads"] == [alone] * 10


def test_fixed_worker_threads():
    with Omni("fake_slow", host=make_host(), placement="process", worker_threads=1) as o:
        trace = o.generate("one two three").trace
    assert trace["words.threads"] == [1, 1, 1] and trace["render.threads"] == [1, 1, 1]
    for bad in ("many", 0, True):
        with pytest.raises(InvalidParameter, match="worker_threads.*integer >= 1 or 'shared'"):
            Omni("fake_slow", host=make_host(), placement="process", worker_threads=bad)


def test_a_worker_waits_on_background_work_instead_of_stepping_in_a_loop(fake_slow_workers):
    """A stage with only background work left (an export on a thread) is waited on (Stage.wait), a few ms at a
    time, by a worker process: a handful of idle steps in 0.3 s, not thousands."""
    result = fake_slow_workers.generate("background please")
    assert result.text == "rendered 2 words in the background"
    assert result.trace["render.idle_steps"] <= 5


def test_a_worker_that_died_while_idle_fails_the_next_submit_in_one_line_then_serves():
    """The death is noticed at the next submit, whose input processing (a call to the entry worker) finds the pipe
    closed and restarts the worker: that submit fails at once, naming the stage, instead of waiting forever for
    a reply the new worker never got; the next one is served."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        assert o.generate("warm up").text == "rendered 2 words"
        words = o.graph.stages["words"]
        dead = words.proc.pid
        os.kill(dead, signal.SIGKILL)
        words.proc.wait(10)
        outcome = []

        def submit():
            try:
                outcome.append(o.submit(o.request("after the death")))
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                outcome.append(exc)

        caller = threading.Thread(target=submit, daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "the submit hung on a reply the restarted worker never got"
        (got,) = outcome
        assert isinstance(got, Exception) and "stage 'words'" in str(got) and "died" in str(got), got
        assert words.proc.pid != dead
        assert o.generate("back again").text == "rendered 2 words"


def within(fn, timeout: float = 30.0):
    """fn() on a thread; its result (or the exception it raised), or a failure if it is still running after
    `timeout` seconds: a hang fails the test instead of hanging the suite."""
    outcome = []

    def run():
        try:
            outcome.append(fn())
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(timeout)
    assert not caller.is_alive(), f"still waiting after {timeout}s: a hang"
    return outcome[0]


def test_an_output_the_worker_cannot_send_fails_that_request_and_the_worker_goes_on():
    """An event that cannot be pickled (a lock in an output's trace) fails its request with one error naming the
    stage, instead of killing the worker's sender thread (after which nothing it sent ever arrived: every request
    of the stage waited forever)."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        done = within(lambda: run_all(o, ["an unsendable_output please", "a fine one"]))
        bad, good = done.values()
        assert isinstance(bad, RequestFailed) and bad.node_id == "render" and bad.kind == "runtime", bad
        assert "stage 'render'" in bad.error and "could not be sent" in bad.error and "lock" in bad.error
        assert isinstance(good, RequestFinished) and good.result.text == "rendered 3 words"
        assert within(lambda: o.generate("after that").text) == "rendered 2 words"


def test_a_processed_input_stays_in_its_worker():
    """A submit is one message: the worker processes the input and adds it, and only the answer (ok, or the
    processing error) comes back, so a processed input the front could not take (a lock in it, or an object only
    the worker can unpickle) never crosses."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        for prompt in ("an unsendable_input please", "an unreadable_input please"):
            got = within(lambda prompt=prompt: o.generate(prompt).text)
            assert got == "rendered 3 words", (prompt, got)
        assert not o.has_unfinished()


def test_a_downstream_input_the_front_cannot_send_fails_that_request_alone():
    """A connector's output that cannot be pickled fails its request at the hand-off, naming the stage, instead
    of raising out of the front's step (which a server takes for a broken engine) with the request left held."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        done = within(lambda: run_all(o, ["an unsendable_handoff please", "a fine one"]))
        assert not isinstance(done, Exception), done
        bad, good = done.values()
        assert isinstance(bad, RequestFailed) and bad.node_id == "render", bad
        assert "stage 'render'" in bad.error and "could not be sent" in bad.error and "lock" in bad.error
        assert isinstance(good, RequestFinished) and good.result.text == "rendered 3 words"
        assert not o.has_unfinished()


def test_close_fails_the_requests_its_workers_held_and_a_later_submit_says_it_was_stopped():
    """close() with requests in flight: each gets its failed event (before, they stayed held by a worker that was
    gone, and a caller stepping until nothing was unfinished spun forever); a submit after close says the stage
    was stopped, not that its worker died while starting."""
    o = Omni("fake_slow", host=make_host(sleep_ms=20), placement="process")
    rid = o.submit(o.request("x " * 30))
    o.step()
    o.close()
    events = within(lambda: drain(o))
    assert not isinstance(events, Exception), events
    (failed,) = [e for e in events if isinstance(e, (RequestFinished, RequestFailed))]
    assert isinstance(failed, RequestFailed) and failed.request_id == rid and failed.node_id == "words", failed
    assert "stage 'words'" in failed.error and "stopped" in failed.error
    with pytest.raises(EngineDead, match="stage 'words'.*stopped"):
        o.submit(o.request("after close"))


def test_close_while_a_submit_waits_on_a_busy_worker_fails_that_call_as_stopped(tmp_path, monkeypatch):
    from omni_kernel.core.request import StageInput
    from omni_workers.messages import Submit

    gate = tmp_path / "gate"
    o = Omni("fake_slow", host=make_host(), placement="process")
    try:
        o.submit(o.request(f"hold={gate} a"))
        step_until_held(o, gate)
        render = o.graph.stages["render"]
        sent, send = threading.Event(), render._send  # a close before the call is sent fails it without a wait

        def spy(message):
            send(message)
            if isinstance(message, Submit):
                sent.set()

        monkeypatch.setattr(render, "_send", spy)
        calls = []
        caller = threading.Thread(target=lambda: calls.append(within(lambda: render.submit(StageInput("r2", "a b")))))
        caller.start()  # answered between two steps: it waits for the held one
        assert sent.wait(30), "the submit was never sent"
        o.close()
        caller.join(60)
        (got,) = calls
        assert isinstance(got, EngineDead) and "stage 'render'" in str(got) and "stopped" in str(got), got
    finally:
        gate.touch()
        o.close()


def test_a_message_the_worker_cannot_read_is_a_worker_fault_not_a_hang():
    """A message the worker cannot unpickle (an object of a class only the front has) used to end the worker's
    reader thread silently: that request, and everything sent to the worker after it, waited forever. The worker
    now exits, logging why, so its requests fail (naming the stage) and it restarts."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        done = within(lambda: run_all(o, ["an unreadable_handoff please"]))
        assert not isinstance(done, Exception), done
        (bad,) = done.values()
        assert isinstance(bad, RequestFailed) and bad.node_id == "render" and "stage 'render'" in bad.error, bad
        assert within(lambda: o.generate("fine now").text) == "rendered 2 words"


def test_a_worker_that_cannot_be_restarted_leaves_its_stage_dead_with_the_reason(monkeypatch):
    """The restart itself fails (no file descriptors left): the stage is dead, saying why, instead of stuck with
    no worker and no error (never restarted, never reported dead)."""
    import omni_workers.spawn as spawn_module

    with Omni("fake_slow", host=make_host(sleep_ms=20), placement="process") as o:
        words = o.graph.stages["words"]
        victim = o.submit(o.request("a b c d e f g h"))
        o.step()

        def no_fds(*args, **kwargs):
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(spawn_module, "launch", no_fds)
        os.kill(words.proc.pid, signal.SIGKILL)
        events = within(lambda: drain(o))
        assert not isinstance(events, Exception), events
        done = {e.request_id: e for e in events if isinstance(e, (RequestFinished, RequestFailed))}
        assert isinstance(done[victim], RequestFailed) and "stage 'words'" in done[victim].error
        with pytest.raises(EngineDead, match="stage 'words'.*could not be restarted.*Too many open files"):
            o.submit(o.request("hello"))


def killed_while_gated(o, node_id: str, gate: Path) -> ProcessStage:
    """Kill a stage's worker with the gate shut, so its restart is a model load that lasts until the gate opens;
    returns once the front has noticed and started the new worker."""
    stage = o.graph.stages[node_id]
    dead = stage.proc.pid
    gate.touch()
    os.kill(dead, signal.SIGKILL)

    def restarted() -> bool:
        o.step() if o.has_unfinished() else o.graph.watch(0.05)
        return stage.proc.pid != dead

    wait_until(restarted, 30, f"the front to notice that {node_id}'s worker died and start another")
    assert not stage.ready
    return stage


def test_a_restarting_worker_fails_calls_at_once_when_the_front_must_not_wait(tmp_path):
    """Built to fail fast (`fail_fast`, as omni serve builds its pipelines), a submit that needs a stage whose worker is
    restarting fails at once, naming it (StageUnavailable), instead of waiting for its model load; requests in
    the other stages go on meanwhile, and once the worker is ready requests are served again."""
    from omni_kernel.core.errors import StageUnavailable

    gate = tmp_path / "gate"
    with Omni("fake_slow", host=make_host(sleep_ms=20), placement="process", fake_build_gate=str(gate),
              fail_fast=True) as o:
        going = o.submit(o.request("render this", fake_steps=40))
        while going not in o.graph.stages["render"].request_ids():
            o.step()
        words = killed_while_gated(o, "words", gate)
        for _ in range(2):
            got = within(lambda: o.submit(o.request("during the restart")), timeout=10)
            assert isinstance(got, StageUnavailable), got
            assert "stage 'words'" in str(got) and "restarting" in str(got) and got.retry_after >= 1
        done = within(lambda: drain(o))
        assert [e for e in done if isinstance(e, (RequestFinished, RequestFailed))] == \
            [e for e in done if isinstance(e, RequestFinished) and e.request_id == going]
        assert not words.ready  # the other stage's request finished while words was still loading
        gate.unlink()
        assert within(lambda: retry(lambda: o.generate("after the restart").text)) == "rendered 3 words"

        render = killed_while_gated(o, "render", gate)  # a downstream stage: its check at submit
        got = within(lambda: o.submit(o.request("during the restart")), timeout=10)
        assert isinstance(got, StageUnavailable) and "stage 'render'" in str(got), got
        gate.unlink()
        assert within(lambda: retry(lambda: o.generate("after the restart").text)) == "rendered 3 words"
        assert render.ready


def test_a_script_waits_for_a_restarting_worker(tmp_path):
    """By default (a script, `omni run`: no other caller to stall) a submit waits for the restarted worker's build,
    then is served; what it sent meanwhile waits in the proxy and reaches the worker once it is ready."""
    gate = tmp_path / "gate"
    with Omni("fake_slow", host=make_host(), placement="process", fake_build_gate=str(gate)) as o:
        killed_while_gated(o, "words", gate)
        outcome = []
        caller = threading.Thread(target=lambda: outcome.append(within(lambda: o.generate("waited for it").text)))
        caller.start()
        time.sleep(0.5)  # a window in which a submit that did not wait would have answered (or failed)
        assert caller.is_alive() and not outcome  # waiting for the build
        gate.unlink()
        caller.join(40)
        assert outcome == ["rendered 3 words"]


def retry(fn, timeout: float = 30.0):
    """fn() again while it raises StageUnavailable (a worker still restarting), as a client would."""
    from omni_kernel.core.errors import StageUnavailable

    def attempt() -> tuple | None:
        try:
            return (fn(),)
        except StageUnavailable:
            return None

    return wait_until(attempt, timeout, "the restarting stage to serve again", interval=0.05)[0]


def test_what_the_front_cannot_read_fails_its_own_request_and_the_stage_serves_on():
    """An output the front cannot unpickle (a class only the worker has) or whose shared-memory array is lost
    fails that request alone, naming the stage, instead of raising out of the front's step (every request of the
    stage failed; a server marked its whole engine dead) or, for a lost file, being taken for a dead worker; a
    processed input the front cannot unpickle fails the submit with one line instead of a raw ImportError."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        render = o.graph.stages["render"].proc.pid
        done = within(lambda: run_all(o, ["an unreadable_output please", "a fine one", "lost_frames please"]))
        assert not isinstance(done, Exception), done
        unreadable, fine, lost = done.values()
        for bad, error in ((unreadable, "ImportError: WorkerOnly exists only in the worker"),
                           (lost, "LookupError: shared array no-such-token")):
            assert isinstance(bad, RequestFailed) and bad.node_id == "render" and bad.kind == "runtime", bad
            assert bad.error.startswith("stage 'render': its output could not be read") and error in bad.error
        assert isinstance(fine, RequestFinished) and fine.result.text == "rendered 3 words"
        assert within(lambda: o.generate("after that").text) == "rendered 2 words"
        assert o.graph.stages["render"].proc.pid == render and o.graph.stages["render"].restarts == 0


FRONT_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from worker_fakes import make_host
    from omni_kernel import Omni
    from omni_workers.cores import board
    o = Omni("echo", host=make_host(), placement="process", worker_threads="shared")
    (stage,) = o.graph.stages.values()
    print(board().dir, flush=True)
    if sys.argv[1] == "hold":
        sys.stdin.read()
    o.close()
""")


def test_a_new_front_removes_the_temporary_directories_of_fronts_that_are_gone(tmp_path):
    """A front killed by SIGTERM (default action: no atexit) leaves its core board directory behind; the
    next front to start removes them, and leaves alone a live front's and those it cannot tell the owner of."""
    script = tmp_path / "front.py"
    script.write_text(FRONT_SCRIPT.format(here=str(HERE)))
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    unknown = temp / "omni-run-abc123"  # an older version's name: no pid
    unknown.mkdir()

    def hold():
        front = subprocess.Popen([sys.executable, str(script), "hold"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env)
        return front, [Path(p) for p in front.stdout.readline().split()]

    killed, killed_dirs = hold()
    live, live_dirs = hold()
    try:
        killed.send_signal(signal.SIGTERM)
        killed.wait(20)
        assert len(killed_dirs) == 1 and all(d.is_dir() for d in killed_dirs)  # left behind
        out = subprocess.run([sys.executable, str(script), "once"], capture_output=True, text=True, env=env,
                             timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert not any(d.exists() for d in killed_dirs)
        assert len(live_dirs) == 1 and all(d.is_dir() for d in live_dirs) and unknown.is_dir()
    finally:
        live.stdin.close()
        live.wait(20)
    assert not any(d.exists() for d in live_dirs)  # its own close and exit


def test_a_stage_that_may_process_beside_a_step_answers_a_submit_while_its_step_runs(tmp_path):
    """An entry stage whose input processing touches no state a step uses (`concurrent_inputs`, as Wan's): its
    worker answers the submit's `process` at once, not after the step running now (a denoise step can take
    seconds), so the front (omni serve's one engine thread) never waits for a step of it."""
    gate = tmp_path / "gate"
    with Omni("fake_video", host=make_host(), placement="process") as o:
        held = o.submit(o.request(f"hold={gate} one"))
        step_until_held(o, gate, timeout=30)  # its step now waits for the gate
        second = within(lambda: o.submit(o.request("two words")), timeout=10)
        assert isinstance(second, str) and not gate.exists(), second  # answered while the step still waits
        gate.touch()
        done = within(lambda: drain(o))
        finished = {e.request_id: e.result.text for e in done if isinstance(e, RequestFinished)}
        assert finished == {held: "rendered 2 words", second: "rendered 2 words"}


def test_the_proxies_keep_the_closed_stage_contract():
    """Every method of protocols.Stage, with its parameters, on ProcessStage and RayStage (the planner calls
    `wait_ready` and the StageScheduler `hand_off` on any stage)."""
    import inspect

    from omni_kernel.core import protocols
    from omni_workers.ray_stage import RayStage

    def params(function):
        parameters = list(inspect.signature(function).parameters.values())[1:]
        return [(p.name, p.kind, p.default is p.empty) for p in parameters]

    for cls in (ProcessStage, RayStage):
        for name in (n for n, v in vars(protocols.Stage).items() if callable(v) and not n.startswith("_")):
            assert params(getattr(cls, name)) == params(getattr(protocols.Stage, name)), (cls, name)


def test_a_worker_proxy_reports_its_stages_own_stats():
    """The worker sends its stage's `stats()` with its events: running and waiting as its scheduler counts them
    (8 of 10 running at the fake's max_batch 8), after an abort too (no step follows), and `restarts` from the
    proxy; `concurrent_inputs` is the worker's stage's."""
    with Omni("fake_slow", host=make_host(sleep_ms=20), placement="process") as o:
        words = o.graph.stages["words"]
        assert words.stats().running == words.stats().waiting == 0 and words.concurrent_inputs is False
        assert o.graph.stages["render"].concurrent_inputs is False
        ids = [o.submit(o.request(" ".join(["w"] * 40))) for _ in range(10)]
        deadline = time.monotonic() + 30
        while (words.stats().running, words.stats().waiting) != (8, 2):
            assert time.monotonic() < deadline, words.stats()
            o.step()
        for rid in ids:
            o.abort(rid)
        while words.stats().running or words.stats().waiting:
            assert time.monotonic() < deadline, words.stats()
            o.graph.watch(0.05)
        assert words.stats().placed.restarts == 0 and words.stats().dead is None
        # an event the worker sent before the abort reached it is dropped, so `watch` goes on pumping
        late = StageFailed(ids[0], "words", "sent before the abort", "runtime")
        words.on_events((Sealed(ids[0], pickle.dumps(late)),), None)
        assert words.pending == [] and not o.graph.placed[0].wait(0)
    with Omni("fake_video", host=make_host(), placement="process") as o:
        assert o.graph.stages["render"].concurrent_inputs is True


def test_a_stage_whose_engine_died_in_its_worker_is_dead_in_the_front():
    """The worker's stats carry its dead engine's reason: the proxy's stats say it, and the stage takes no more
    requests (engine_dead), as an in-process stage whose engine died."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        done = run_all(o, ["explode now please"])
        (failed,) = done.values()
        assert isinstance(failed, RequestFailed) and failed.kind == "engine_dead", failed
        words = o.graph.stages["words"]
        deadline = time.monotonic() + 10
        while words.stats().dead is None:
            assert time.monotonic() < deadline
            o.graph.watch(0.05)
        assert "injected scheduler fault" in words.stats().dead
        (again,) = run_all(o, ["one two"]).values()
        assert isinstance(again, RequestFailed) and again.kind == "engine_dead", again


def test_the_stages_of_one_share_key_live_in_one_worker_die_and_come_back_together():
    """One worker hosts every stage of one share key, of two graphs of the host: each gets its own events (by
    tag), a kill fails the requests of all of them and the restarted worker builds them all again; one graph
    closing leaves the other served, and the worker stops with the last of its stages."""
    host = make_host(sleep_ms=20, shared=True)
    with Omni("fake_slow", host=host, placement="process") as o:
        with Omni("fake_video", host=host, placement="process") as v:
            words, render, lone = o.graph.stages["words"], o.graph.stages["render"], v.graph.stages["render"]
            worker = render.proc
            assert lone.proc is worker and words.proc is not worker  # one worker per share key: the render engine's
            assert o.generate("two words").text == "rendered 2 words" and "2" in v.generate("one two").text
            victim = o.submit(o.request("a b c d e f g h"))
            alone = v.submit(v.request("x " * 30))
            while victim not in render.request_ids() or alone not in lone.request_ids():
                o.step()
                v.step()
            os.kill(worker.pid, signal.SIGKILL)
            failed = {}
            while o.has_unfinished() or v.has_unfinished():
                failed.update({e.request_id: e for e in o.step() + v.step() if isinstance(e, RequestFailed)})
            assert sorted(failed) == sorted([victim, alone]), failed
            assert all("SIGKILL" in e.error and "restarted" in e.error for e in failed.values())
            assert render.proc is lone.proc and render.proc.pid != worker.pid
            assert o.generate("back again").text == "rendered 2 words" and "2" in v.generate("one two").text
            assert lone.stats().placed.restarts == render.stats().placed.restarts == 1
        survivor = render.proc
        assert survivor.poll() is None and o.generate("still here").text == "rendered 2 words"
    assert survivor.wait(10) is not None and not alive(worker.pid)


def test_replicas_share_a_burst_and_a_killed_one_fails_only_its_own_requests():
    """`replicas="words=2"`: two copies of the words stage, each in a worker of its own, behind one stage; a burst
    is spread by least outstanding work (4 and 4), every request as it is alone; a replica killed mid-burst fails
    its own requests only, while the other's finish, and comes back; the stats add them up and list each one."""
    from omni_workers.replicas import ReplicaStage

    with Omni("fake_slow", host=make_host(sleep_ms=20), placement="process", replicas="words=2") as o:
        words = o.graph.stages["words"]
        assert isinstance(words, ReplicaStage) and not isinstance(o.graph.stages["render"], ReplicaStage)
        first, second = words.replicas
        assert first.proc.pid != second.proc.pid
        prompts = [" ".join(["w"] * (30 + i)) for i in range(8)]  # none ends before the kill
        ids = [o.submit(o.request(p)) for p in prompts]
        assert sorted(collections.Counter(id(words.owner[rid]) for rid in ids).values()) == [4, 4]
        on_first = {rid for rid in ids if words.owner[rid] is first}
        victim = first.proc.pid
        os.kill(victim, signal.SIGKILL)
        done = {e.request_id: e for e in drain(o) if isinstance(e, (RequestFinished, RequestFailed))}
        for rid, prompt in zip(ids, prompts):
            if rid in on_first:
                assert isinstance(done[rid], RequestFailed) and "SIGKILL" in done[rid].error, done[rid]
            else:
                assert done[rid].result.text == f"rendered {len(prompt.split())} words", done[rid]
        assert first.proc.pid != victim and o.generate("back again").text == "rendered 2 words"
        stats = words.stats()
        assert [s.placed.restarts for s in stats.placed.replicas] == [1, 0] and stats.placed.restarts == 1
        assert stats.dead is None


def test_bad_replica_settings_are_refused_in_one_line():
    with pytest.raises(InvalidParameter, match="replicas: '0' is not an integer >= 1"):
        Omni("fake_slow", host=make_host(), placement="process", replicas="words=0")
    with pytest.raises(InvalidParameter, match="node 'words' runs inproc; replicas need placement process or ray"):
        Omni("fake_slow", host=make_host(), replicas=2)
    with pytest.raises(InvalidParameter, match="replicas: pipeline 'fake_slow' has no node 'video'"):
        Omni("fake_slow", host=make_host(), placement="process", replicas="video=2")
    result = CliRunner().invoke(main, ["run", "--pipeline", "fake_slow", "--prompt", "hi", "--placement", "process",
                                       "--replicas", "words=x"], obj={"host": make_host()})
    assert result.exit_code == 2 and "invalid replicas: 'x' is not an integer >= 1" in result.output, result.output
