"""Video jobs that survive the server (the job store, omni_serve/store.py and restore.py), on real `omni serve`
processes of wan_t2v (the tiny demo checkpoint; one job at a time, `-c wan_max_batch=1`) killed with SIGKILL:
three jobs across a `kill -9` under each --on-restart policy, a kill during each kind of state write (the
store_faults plugin), kills at random moments under a burst of jobs, a second server and a corrupt store refused
at start, and a full disk (ENOSPC, injected) failing the one request that met it."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from omni_kernel.testing import wait_until

from serving import ServerProcess, video_done

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

ARGS = ["--pipeline", "wan_t2v", "--shutdown-timeout", "2", "-c", "wan_max_batch=1"]
PLUGINS = ("store_faults:StoreFaults",)
QUICK = {"model": "wan_t2v", "prompt": "a lighthouse", "size": "96x64", "num_frames": "9",
         "num_inference_steps": "2", "seed": "1"}
LONG = {**QUICK, "size": "192x192", "num_frames": "33", "num_inference_steps": "200"}  # 3-4 s here
TERMINAL = ("completed", "failed")
ROUNDS = int(os.environ.get("OMNI_TEST_KILL_ROUNDS", "20"))
BURST = 6  # jobs a round submits at most


def start(tmp: Path, name: str, out: Path, *extra: str, fault: str = "", ready: bool = True,
          fork: bool = True) -> ServerProcess:
    proc = ServerProcess([*ARGS, "--output-dir", str(out), *extra], tmp / f"{name}.log", plugins=PLUGINS,
                         env={"OMNI_TEST_STORE_FAULT": fault}, fork=fork)
    return proc.wait_ready() if ready else proc


def killed(proc: ServerProcess) -> None:
    """The server ended by SIGKILL (its own, at the injected fault, or ours)."""
    proc.kill()
    proc.log.close()
    assert proc.proc.returncode == -9, proc.output()[-2000:]


def died(proc: ServerProcess, timeout: float = 120) -> None:
    wait_until(lambda: proc.proc.poll() is not None, timeout, "the server to kill itself at the fault", interval=0.05)
    killed(proc)


def post(http: httpx.Client, fields: dict) -> str | None:
    """A job's id once the server acknowledged it; None when the server died first."""
    try:
        r = http.post("/v1/videos", data=fields)
    except httpx.HTTPError:
        return None
    assert r.status_code == 200, r.text
    return r.json()["id"]


def listed(http: httpx.Client) -> dict[str, dict]:
    """Every job the server lists (all pages), by id."""
    jobs: dict[str, dict] = {}
    after = None
    while True:
        page = http.get("/v1/videos", params={"limit": 100, "order": "asc", **({"after": after} if after else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        jobs.update({j["id"]: j for j in body["data"]})
        if not body["has_more"]:
            return jobs
        after = body["last_id"]


def all_end(http: httpx.Client, ids, timeout: float = 180) -> dict[str, dict]:
    """Every job of `ids` in a terminal state (each completed one's content downloads); returns them."""
    ends = {i: video_done(http, i, timeout) for i in ids}
    for job_id, job in ends.items():
        if job["status"] == "completed":
            content = http.get(f"/v1/videos/{job_id}/content")
            assert content.status_code == 200 and content.content[4:8] == b"ftyp", job
    return ends


def in_progress(http: httpx.Client, job_id: str) -> dict:
    return wait_until(lambda: (j := http.get(f"/v1/videos/{job_id}").json())["progress"] > 0 and j, 60,
                      "the job's first denoise steps", interval=0.02)


@pytest.mark.parametrize("policy", ["rerun", "fail"])
def test_three_jobs_across_a_kill_9_reach_the_end_the_flag_says(tmp_path, omni_cache, policy):
    out = tmp_path / "videos"
    first = start(tmp_path, "first", out, "--on-restart", policy)
    with httpx.Client(base_url=first.url, timeout=60) as http:
        done = post(http, QUICK)
        assert video_done(http, done)["status"] == "completed"
        content = http.get(f"/v1/videos/{done}/content").content
        running, queued = post(http, LONG), post(http, QUICK)
        in_progress(http, running)
        assert http.get(f"/v1/videos/{queued}").json()["status"] == "queued"
    killed(first)

    second = start(tmp_path, "second", out, "--on-restart", policy)
    with httpx.Client(base_url=second.url, timeout=60) as http:
        assert set(listed(http)) == {done, running, queued}
        assert http.get(f"/v1/videos/{done}/content").content == content  # byte for byte
        ends = all_end(http, [done, running, queued])
        assert ends[queued]["status"] == "completed"
        if policy == "rerun":
            assert ends[running]["status"] == "completed", ends[running]
        else:
            assert ends[running]["status"] == "failed" and ends[running]["error"]["code"] == "server_restarted"
        assert set(listed(http)) == {done, running, queued}
        metrics = http.get("/metrics").text
        assert f'omni_video_jobs{{status="completed"}} {2.0 if policy == "fail" else 3.0}' in metrics
    assert second.stop() == 0, second.output()
    log = second.output()
    assert f"videos in {out}, job store {out / 'jobs.sqlite'}" in log
    assert f"video job {running}: in progress when the server stopped" in log


# (kind, phase): the write the server dies in, at its first occurrence.
KILLS = [("queued", "during"), ("queued", "after"), ("in_progress", "during"), ("progress", "during"),
         ("progress", "after"), ("completed", "during"), ("completed", "after"), ("deleted", "during"),
         ("deleted", "after"), ("purged", "during"), ("requeued", "during"), ("failed", "during")]


def _die_at(tmp_path: Path, out: Path, kind: str, phase: str) -> set[str]:
    """Drive a server until it kills itself at the write; the ids it acknowledged (and has not deleted)."""
    fault = f"kill:{kind}:1:{phase}"
    if kind in ("requeued", "failed"):  # written at start, for a job in progress when the server died
        first = start(tmp_path, "first", out)
        with httpx.Client(base_url=first.url, timeout=60) as http:
            job = post(http, LONG)
            in_progress(http, job)
        killed(first)
        policy = "rerun" if kind == "requeued" else "fail"
        died(start(tmp_path, "faulty", out, "--on-restart", policy, fault=fault, ready=False))
        return {job}
    server = start(tmp_path, "faulty", out, fault=fault)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        job = post(http, QUICK)
        if kind in ("deleted", "purged"):
            video_done(http, job)
            with pytest.raises(httpx.HTTPError):
                http.delete(f"/v1/videos/{job}")
    died(server)
    return {job} - {None}


@pytest.mark.parametrize("kind, phase", KILLS)
def test_a_kill_during_each_kind_of_state_write_leaves_a_store_that_opens_and_jobs_that_end(tmp_path, omni_cache,
                                                                                            kind, phase):
    out = tmp_path / "videos"
    acknowledged = _die_at(tmp_path, out, kind, phase)
    after = start(tmp_path, "after", out, "--on-restart", "rerun")
    with httpx.Client(base_url=after.url, timeout=60) as http:
        jobs = listed(http)
        if kind in ("deleted", "purged") and (phase == "after" or kind == "purged"):
            assert not jobs and not list(out.glob("video_*.mp4")), jobs  # deleted: its files removed at start
        else:
            assert acknowledged <= set(jobs), (acknowledged, jobs)
        assert all(j["status"] in TERMINAL for j in all_end(http, jobs).values())
    assert after.stop() == 0, after.output()


def _burst(url: str, rng: random.Random, acknowledged: set[str], stop: threading.Event) -> None:
    """Up to BURST jobs, a few ms to 150 ms apart, until the server dies."""
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(BURST):
            fields = {**QUICK, "num_inference_steps": str(rng.choice((2, 20, 120)))}
            if stop.is_set() or (job := post(http, fields)) is None:
                return
            acknowledged.add(job)
            stop.wait(rng.uniform(0.005, 0.15))


def test_kill_9_at_random_moments_under_a_burst_of_jobs(tmp_path, omni_cache):
    """20 server starts, each killed with SIGKILL at a seeded random moment of a burst of jobs (the issue asks for
    20): after each restart every acknowledged job id is listed, and at the end every job reached a terminal state.
    Over 30 s (about 2 minutes on 2 cores) because each round starts a real server process and loads the tiny Wan
    model; the kills by kind of write are the other test, one start each."""
    out, rng, acknowledged = tmp_path / "videos", random.Random(34), set()
    for round in range(ROUNDS):
        server = start(tmp_path, f"round{round}", out, "--on-restart", "rerun")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            missing = acknowledged - set(listed(http))
            assert not missing, (round, missing)
        stop = threading.Event()
        burst = threading.Thread(target=_burst, args=(server.url, rng, acknowledged, stop))
        burst.start()
        time.sleep(rng.uniform(0.05, 1.5))
        killed(server)
        stop.set()
        burst.join(30)
    last = start(tmp_path, "last", out, "--on-restart", "rerun")
    with httpx.Client(base_url=last.url, timeout=60) as http:
        jobs = listed(http)
        assert acknowledged <= set(jobs)
        ends = all_end(http, jobs, timeout=300)
        assert all(j["status"] in TERMINAL for j in ends.values())
        print(f"{ROUNDS} kills, {len(acknowledged)} jobs acknowledged, {len(jobs)} in the store: "
              f"{sum(j['status'] == 'completed' for j in ends.values())} completed")
    assert last.stop() == 0, last.output()


def _refused(proc: ServerProcess) -> str:
    """The one line a server that refused to start wrote last (it exits 1 before loading a model)."""
    assert proc.proc.wait(120) == 1, proc.output()
    proc.log.close()
    return proc.output().strip().splitlines()[-1]


def test_a_second_server_on_the_same_store_is_refused(tmp_path, omni_cache):
    out = tmp_path / "videos"
    first = start(tmp_path, "first", out)
    try:
        line = _refused(start(tmp_path, "second", out, ready=False))
        assert "is in use by another omni serve" in line and str(out) in line, line
        line = _refused(start(tmp_path, "third", tmp_path / "elsewhere", "--jobs-db", str(out / "jobs.sqlite"),
                              ready=False))
        assert f"{out / 'jobs.sqlite.lock'} is in use by another omni serve (pid {first.proc.pid})" in line, line
        with httpx.Client(base_url=first.url, timeout=60) as http:  # the first one is untouched
            assert video_done(http, post(http, QUICK))["status"] == "completed"
    finally:
        assert first.stop() == 0, first.output()


@pytest.mark.parametrize("content", [b"not a database, just bytes\n" * 100, b"SQLite format 3\x00" + b"\xff" * 4000],
                         ids=["not-sqlite", "sqlite-header-then-garbage"])
def test_a_corrupt_store_refuses_the_start_in_one_line_naming_the_file_and_what_to_do(tmp_path, omni_cache,
                                                                                      content):
    db = tmp_path / "jobs.sqlite"
    db.write_bytes(content)
    line = _refused(start(tmp_path, "server", tmp_path / "videos", "--jobs-db", str(db), ready=False))
    assert f"cannot use the job store {db}: " in line and f"mv {db} {db}.broken" in line, line
    assert db.read_bytes() == content  # untouched


def test_a_full_disk_fails_the_one_request_that_met_it(tmp_path, omni_cache):
    faults = "enospc:queued:1,enospc:upload:1,enospc:progress:1"
    server = start(tmp_path, "server", tmp_path / "videos", fault=faults)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/videos", data=QUICK)  # the job's first write: refused, nothing kept
            assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage", r.text
            assert "disk is full" in r.json()["error"]["message"]
            r = http.post("/v1/videos", data=QUICK, files={"input_reference": ("i.png", os.urandom(300_000))})
            assert r.status_code == 507 and r.json()["error"]["param"] == "input_reference", r.text
            assert not list((tmp_path / "videos" / ".uploads").glob("*"))  # what it had written is gone
            failed = video_done(http, post(http, QUICK))  # accepted; its progress could not be recorded
            assert failed["status"] == "failed" and failed["error"]["code"] == "insufficient_storage", failed
            fine = video_done(http, post(http, QUICK))
            assert fine["status"] == "completed", fine
            assert set(listed(http)) == {failed["id"], fine["id"]}
            assert http.get("/health").status_code == 200
    finally:
        assert server.stop() == 0, server.output()


def test_a_19_mb_upload_is_streamed_to_disk_not_held_in_memory(tmp_path, omni_cache):
    from test_server_limits import rss_mb

    out = tmp_path / "videos"
    server = start(tmp_path, "server", out, fork=False)  # its RSS is read
    size, boundary = 19_000_000, "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\np\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"input_reference\"; filename=\"big.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()
    block, samples = os.urandom(1 << 16), []

    def body():
        yield head
        for _ in range(size // len(block)):
            samples.append(rss_mb(server.proc.pid))
            yield block
        yield f"\r\n--{boundary}--\r\n".encode()

    try:
        before = rss_mb(server.proc.pid)
        r = httpx.post(server.url + "/v1/videos", content=body(), timeout=120,
                       headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text  # t2v: no image
        print(f"RSS {before:.0f} MB before a 19 MB upload, at most {max(samples):.0f} MB while it arrived")
        assert max(samples) < before + 12, (before, max(samples))  # 19 MB held anywhere would show
        assert not list((out / ".uploads").glob("*")) if (out / ".uploads").exists() else True
    finally:
        assert server.stop() == 0, server.output()
