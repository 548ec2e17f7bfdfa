"""One diffusion engine per model: wan_i2v, wan_t2v and qwen_to_wan_i2v built on one plugin host share it (one
copy of the weights, one batch), each pipeline gets back its own requests' events, the same request id in two
pipelines of one host is refused at submit in one line, and a request aborted in one pipeline leaves the other's
alone."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from omni_kernel import InvalidParameter, Omni, RequestFailed, RequestFinished

SIZE = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 4}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "red.png"
    Image.new("RGB", (120, 80), "red").save(path)
    return str(path)


@pytest.fixture(scope="module")
def pipelines(omni, tiny_model):
    """wan_i2v (the session's) and wan_t2v on one host, the same model and config."""
    return omni, Omni("wan_t2v", host=omni.host, model=str(tiny_model), device="cpu")


def step_in_turn(*omnis, events: dict | None = None, until=None) -> dict:
    """Step each pipeline with work in turn, as `omni serve`'s engine thread does, until none has work (or
    `until(events)`); each pipeline's events, added to `events` if given."""
    events = events if events is not None else {o: [] for o in omnis}
    while any(o.has_unfinished() for o in omnis) and not (until and until(events)):
        for o in omnis:
            if o.has_unfinished():
                events[o] += o.step()
    return events


def tensors(stage) -> set[int]:
    model = stage.engine.runner.model.pipe.transformer
    return {p.data_ptr() for p in model.parameters()}


def test_wan_pipelines_share_one_engine_and_one_copy_of_the_weights(pipelines, tiny_model):
    i2v, t2v = pipelines
    chained = Omni("qwen_to_wan_i2v", host=i2v.host, model=str(tiny_model), device="cpu")
    stages = [i2v.graph.stages["wan"], t2v.graph.stages["wan"], chained.graph.stages["video"]]
    assert len({id(s.engine) for s in stages}) == 1  # one engine under three stages
    assert len({id(s.inputs) for s in stages}) == 3  # each its own image policy
    assert tensors(stages[0]) == tensors(stages[2])


def test_requests_of_two_pipelines_share_forwards_get_their_own_events_and_match_solo(pipelines, image, tmp_path):
    i2v, t2v = pipelines
    i2v.submit(i2v.request("a red fox in the snow", image=image, request_id="i", seed=1, output=str(tmp_path / "i.mp4"),
                           return_frames=True, **SIZE))
    t2v.submit(t2v.request("a kite over a field", request_id="t", seed=2, output=str(tmp_path / "t.mp4"),
                           return_frames=True, **SIZE))
    events = step_in_turn(i2v, t2v)
    assert {e.request_id for e in events[i2v]} == {"i"} and {e.request_id for e in events[t2v]} == {"t"}
    finished = {e.request_id: e.result for got in events.values() for e in got if isinstance(e, RequestFinished)}
    assert sorted(finished) == ["i", "t"]
    for result in finished.values():
        assert result.trace["diffusion.batch_size_max"] == 2, result.trace  # one forward for both pipelines
    alone = {"i": i2v.generate("a red fox in the snow", image=image, seed=1, output=str(tmp_path / "i1.mp4"),
                               return_frames=True, **SIZE),
             "t": t2v.generate("a kite over a field", seed=2, output=str(tmp_path / "t1.mp4"), return_frames=True,
                               **SIZE)}
    for rid, solo in alone.items():
        assert solo.trace["diffusion.batch_size_max"] == 1
        diff = float(np.abs(finished[rid].output.data["frames"] - solo.output.data["frames"]).max())
        print(f"{rid}: shared-batch frames vs solo, max abs diff {diff:.2e}")
        assert diff <= 1e-4


def test_one_request_id_in_two_pipelines_and_an_abort_in_one(pipelines, image, tmp_path):
    i2v, t2v = pipelines
    i2v.submit(i2v.request("a boat", image=image, request_id="same", seed=3, output=str(tmp_path / "a.mp4"), **SIZE))
    with pytest.raises(InvalidParameter, match="'same' is already in flight"):  # one host, one scheduler
        t2v.submit(t2v.request("a boat", request_id="same", seed=3, output=str(tmp_path / "b.mp4"), **SIZE))
    t2v.submit(t2v.request("a city street", request_id="other", seed=4, output=str(tmp_path / "c.mp4"), **SIZE))
    events = step_in_turn(i2v, t2v, until=lambda got: any(getattr(e, "step", 0) >= 1 for e in got[i2v]))
    i2v.abort("same")
    step_in_turn(i2v, t2v, events=events)
    failed = {o: [(e.request_id, e.error) for e in events[o] if isinstance(e, RequestFailed)] for o in events}
    assert failed == {i2v: [("same", "aborted")], t2v: []}
    assert [e.request_id for e in events[t2v] if isinstance(e, RequestFinished)] == ["other"]
    assert not (tmp_path / "a.mp4").exists() and not (tmp_path / "b.mp4").exists()
    assert (tmp_path / "c.mp4").is_file()
    assert not i2v.graph.stages["wan"].engine.request_ids()  # nothing left behind in the shared engine


@pytest.mark.process
def test_with_worker_processes_the_pipelines_share_one_worker_and_its_batches(pipelines, image, tmp_path):
    """`placement="process"`: the Wan nodes of two pipelines (one share key: the same config) are hosted by one
    worker, so their requests share its forwards there as in one process; each pipeline gets its own events,
    equal to the in-process runs, and the worker lives until the last of its pipelines closes."""
    i2v_here, t2v_here = pipelines
    model = str(i2v_here.graph.stages["wan"].engine.runner.layout.path)
    i2v = Omni("wan_i2v", host=i2v_here.host, model=model, device="cpu", placement="process")
    t2v = Omni("wan_t2v", host=i2v_here.host, model=model, device="cpu", placement="process")
    try:
        worker = i2v.graph.stages["wan"].proc
        assert t2v.graph.stages["wan"].proc is worker and worker.poll() is None
        requests = {"i": dict(prompt="a red fox in the snow", image=image, seed=1), "t": dict(prompt="a kite", seed=2)}
        i2v.submit(i2v.request(**requests["i"], request_id="i", output=str(tmp_path / "i.mp4"), return_frames=True,
                               **SIZE))
        t2v.submit(t2v.request(**requests["t"], request_id="t", output=str(tmp_path / "t.mp4"), return_frames=True,
                               **SIZE))
        events = step_in_turn(i2v, t2v)
        assert {e.request_id for e in events[i2v]} == {"i"} and {e.request_id for e in events[t2v]} == {"t"}
        finished = {e.request_id: e.result for got in events.values() for e in got if isinstance(e, RequestFinished)}
        assert sorted(finished) == ["i", "t"]
        assert max(r.trace["diffusion.batch_size_max"] for r in finished.values()) == 2  # one forward for both
        for rid, here in (("i", i2v_here), ("t", t2v_here)):
            solo = here.generate(**requests[rid], output=str(tmp_path / f"{rid}1.mp4"), return_frames=True, **SIZE)
            assert float(np.abs(finished[rid].output.data["frames"] - solo.output.data["frames"]).max()) <= 1e-4
        i2v.close()
        after = t2v.generate("a kite", seed=2, output=str(tmp_path / "after.mp4"), **SIZE)
        assert worker.poll() is None and after.output.path == str(tmp_path / "after.mp4")
    finally:
        i2v.close()
        t2v.close()
    assert worker.wait(10) is not None  # stopped with the last of its stages
