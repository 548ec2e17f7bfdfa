"""qwen_to_wan_i2v with each stage in its own worker process (placement `process`), on the tiny demo
checkpoints: the same video and text as in-process, frames through a file, abort and a user error at submit;
two workers building one demo checkpoint at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.core.errors import InvalidParameter
from omni_kernel.events import RequestFailed, RequestFinished
from omni_workers.process_stage import ProcessStage

pytestmark = [pytest.mark.process]

IMAGE = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
PROMPT = "a red fox trotting through fresh snow"


def test_the_pipeline_in_worker_processes_matches_inproc(omni_cache, tmp_path):
    np = pytest.importorskip("numpy")
    params = dict(image=str(IMAGE), max_tokens=6, seed=3, return_frames=True)
    inproc = Omni("qwen_to_wan_i2v", device="cpu")
    want = inproc.generate(PROMPT, output=str(tmp_path / "inproc.mp4"), **params)
    with Omni("qwen_to_wan_i2v", device="cpu", placement="process", worker_threads=1) as omni:
        assert all(isinstance(s, ProcessStage) for s in omni.graph.stages.values())
        got = omni.generate(PROMPT, output=str(tmp_path / "process.mp4"), **params)
        assert got.outputs["bridge"].text == want.outputs["bridge"].text
        assert Path(got.path).is_file() and got.path.endswith("process.mp4")
        assert np.allclose(got.output.data["frames"], want.output.data["frames"], atol=1e-4)
        assert got.trace["diffusion.prompt"] == want.trace["diffusion.prompt"]

        with pytest.raises(InvalidParameter):  # the video node's check runs in its worker, still synchronous
            omni.submit(omni.request(PROMPT, image=str(IMAGE), output=str(tmp_path / "x.txt")))
        assert not omni.has_unfinished()

        rid = omni.submit(omni.request(PROMPT, image=str(IMAGE), max_tokens=6, output=str(tmp_path / "a.mp4")))
        omni.step()
        omni.abort(rid)
        events = []
        while omni.has_unfinished():
            events += omni.step()
        assert isinstance(events[-1], RequestFailed) and events[-1].kind == "aborted"
        assert not (tmp_path / "a.mp4").exists()


def test_two_workers_build_one_demo_checkpoint_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))  # the workers inherit it: nothing built yet
    omnis, errors = [], []

    def build():
        try:
            omnis.append(Omni("ar_text", placement="process", worker_threads=1))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    try:
        assert not errors and len(omnis) == 2
        results = [o.generate("hello", max_tokens=4, seed=0).text for o in omnis]
        assert results[0] == results[1]
        demo = tmp_path / "cache" / "demo"
        assert sorted(p.name for p in demo.iterdir()) == ["qwen2-tiny"]  # no leftover staging directory
    finally:
        for o in omnis:
            o.close()


def test_many_requests_through_both_workers(omni_cache, tmp_path):
    with Omni("qwen_to_wan_i2v", device="cpu", placement="process", worker_threads=1) as omni:
        ids = [omni.submit(omni.request(f"{PROMPT} {i}", image=str(IMAGE), max_tokens=4, seed=i,
                                        output=str(tmp_path / f"{i}.mp4"))) for i in range(3)]
        done = {}
        while omni.has_unfinished():
            done.update({e.request_id: e for e in omni.step() if isinstance(e, (RequestFinished, RequestFailed))})
        assert all(isinstance(done[i], RequestFinished) for i in ids), done
        assert all((tmp_path / f"{i}.mp4").is_file() for i in range(3))
