"""GPU check (not in CI): a real `omni serve` process on a CUDA device, driven by the official openai client.

It serves ar_text, wan_i2v and qwen_to_wan_i2v on 127.0.0.1 (a free port): the AR stage on
benchmarks/gpu_ar_check.py's SmolLM2-shaped random checkpoint (or `--ar-model DIR`) in bf16, the Wan stage on the
tiny demo checkpoint. Per placement (`inproc`, then `process` when time is left), one JSON line with:

- `startup_s` and `kv_pool` (the pool's line from the server's log);
- `chat_stream`: a streamed chat (temperature 0): time to the first text chunk, chunks, usage, finish reason,
  and whether the same chat unstreamed gives the same text;
- `video` / `bridge_video`: a wan_i2v and a qwen_to_wan_i2v job through `client.videos` (create with an image,
  poll, download): seconds, status, the MP4's frame count and size; `chat_during_video`: a chat that runs while a
  video job denoises (its time to first chunk);
- `t2v`: text-to-video is "not built yet" unless a `wan_t2v` pipeline is registered, then one job without image;
- `metrics`: a few /metrics samples; `exit_code`: the server's status after SIGTERM (0 is a clean stop).

    HF_HUB_OFFLINE=1 python benchmarks/gpu_serve_check.py [--device cpu] [--ar-model DIR] [--budget-s 120]

`--device cpu` is a dry run of the same code (the stages on the CPU, smaller requests). The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", "The Sora API", DeprecationWarning)  # client.videos is marked deprecated
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "examples" / "assets" / "image.png"
LAUNCH = "import sys; from omni_kernel.cli import main; main(args=sys.argv[1:], prog_name='omni')"
CHAT = [{"role": "user", "content": "Describe a school in one sentence."}]
STOP_S = 12  # kept for the server's SIGTERM stop


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(section: str, value) -> None:
    print(json.dumps({section: value}), flush=True)


def error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}


class Server:
    """`omni serve` in a subprocess (the `omni` entry point's code), its log in a file."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--host", "127.0.0.1", "--port",
                                      str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> float:
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omni serve exited with {self.proc.returncode}: {self.output()[-600:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"omni serve did not answer /health within {timeout:.0f}s: {self.output()[-600:]}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = STOP_S - 2) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        self.log.close()
        return self.proc.returncode


def chat_stream(client, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, chunks, texts, usage, finish = None, 0, [], None, None
    for chunk in client.chat.completions.create(model="ar_text", messages=CHAT, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        if chunk.choices:
            if chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                chunks += 1
                texts.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
    elapsed = time.perf_counter() - start
    whole = client.chat.completions.create(model="ar_text", messages=CHAT, max_tokens=max_tokens, temperature=0)
    return {"ttft_s": None if first is None else round(first, 3), "total_s": round(elapsed, 3), "chunks": chunks,
            "usage": usage, "finish_reason": finish, "text_start": "".join(texts)[:80],
            "same_as_unstreamed": whole.choices[0].message.content == "".join(texts)}


def video(client, model: str, size: str, frames: int, steps: int, out: Path, image: bool = True) -> dict:
    import imageio_ffmpeg

    start = time.perf_counter()
    extra = {"num_frames": frames, "num_inference_steps": steps, "seed": 1}
    if image:
        with open(IMAGE, "rb") as f:
            job = client.videos.create(model=model, prompt="a lighthouse at dusk", input_reference=f, size=size,
                                       extra_body=extra)
    else:
        job = client.videos.create(model=model, prompt="a lighthouse at dusk", size=size, extra_body=extra)
    done = client.videos.poll(job.id, poll_interval_ms=100)
    result = {"status": done.status, "seconds": round(time.perf_counter() - start, 3), "progress": done.progress}
    if done.status != "completed":
        result["error"] = str(done.error)
        return result
    client.videos.download_content(job.id).write_to_file(out)
    reader = imageio_ffmpeg.read_frames(str(out))
    meta = reader.__next__()
    result.update(frames=sum(1 for _ in reader), size=list(meta["size"]), mp4_bytes=out.stat().st_size)
    return result


def chat_during_video(client, size: str, frames: int, steps: int, out: Path, max_tokens: int) -> dict:
    """A chat that starts while a video job denoises: its time to first chunk (the video's job is the load)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(video(client, "wan_i2v", size, frames, steps, out)),
                              daemon=True)
    thread.start()
    time.sleep(0.5)
    chat = chat_stream(client, max_tokens)
    thread.join(300)
    return {"chat_ttft_s": chat["ttft_s"], "chat_total_s": chat["total_s"], "video": box or {"error": "no result"}}


def metrics(url: str) -> dict:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    keep = ("omni_kv_blocks_total", "omni_denoise_step_seconds_count", "omni_generated_tokens_total",
            "omni_time_to_first_token_seconds_sum", "omni_video_jobs", "omni_stage_errors_total")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(keep)}


def serve_once(placement: str, ckpt: Path, work: Path, cpu: bool, deadline: float) -> dict:
    import openai

    from omni_kernel.plugins import load_host

    size, frames, steps, max_tokens = ("64x96", 9, 3, 8) if cpu else ("256x256", 17, 8, 32)
    args = ["--pipeline", "ar_text", "--pipeline", "wan_i2v", "--pipeline", "qwen_to_wan_i2v",
            "--ar-model", str(ckpt), "-c", "ar_dtype=bf16", "--output-dir", str(work / f"videos-{placement}"),
            "--shutdown-timeout", "10", "--placement", placement]
    if cpu:
        args += ["-c", "ar_device=cpu", "-c", "device=cpu"]
    t2v = "wan_t2v" in load_host().registry.pipelines
    args += ["--pipeline", "wan_t2v"] if t2v else []
    server = Server(args, work / f"server-{placement}.log")
    result: dict = {"placement": placement}
    if not t2v:
        result["t2v"] = {"skipped": "not built yet: no wan_t2v pipeline is registered"}
    try:
        result["startup_s"] = round(server.wait_ready(max(10.0, deadline - time.monotonic())), 1)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
        result["models"] = sorted(m.id for m in client.models.list().data)
        parts = {"chat_stream": lambda: chat_stream(client, max_tokens),
                 "video": lambda: video(client, "wan_i2v", size, frames, steps, work / f"{placement}-i2v.mp4"),
                 "bridge_video": lambda: video(client, "qwen_to_wan_i2v", size, frames, steps,
                                               work / f"{placement}-bridge.mp4"),
                 "chat_during_video": lambda: chat_during_video(client, size, frames, steps * 3,
                                                                work / f"{placement}-load.mp4", max_tokens)}
        if t2v:
            parts["t2v"] = lambda: video(client, "wan_t2v", size, frames, steps, work / f"{placement}-t2v.mp4",
                                         image=False)
        for name, part in parts.items():
            if time.monotonic() > deadline - 15:
                result[name] = {"skipped": "out of this part's time"}
                continue
            try:
                result[name] = part()
            except Exception as exc:  # noqa: BLE001 - recorded; the other parts go on
                result[name] = error(exc)
        result["metrics"] = metrics(server.url)
        pool = re.findall(r"\S+: \w+ KV backend, .*", server.output())  # logged at start, or at the first request
        result["kv_pool"] = pool[0] if pool else None
    except Exception as exc:  # noqa: BLE001
        result.update(error(exc))
    finally:
        result["exit_code"] = server.stop()
        result["log_tail"] = server.output()[-400:] if "error" in result or result["exit_code"] != 0 else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--ar-model", default=None, help="a real causal-LM directory instead of the random one")
    parser.add_argument("--layers", type=int, default=None, help="layers of the random checkpoint (cuda 30, cpu 4)")
    parser.add_argument("--budget-s", type=float, default=150, help="this check's time; a placement after the first "
                                                                     "runs only if enough is left")
    parser.add_argument("--placements", default="inproc,process")
    args = parser.parse_args()
    start = time.monotonic()
    cpu = args.device == "cpu"
    from gpu_ar_check import ensure_checkpoint

    ckpt = Path(args.ar_model) if args.ar_model else ensure_checkpoint("qwen2", args.layers or (4 if cpu else 30))
    report: dict = {"check": "gpu_serve", "device": args.device, "ar_model": str(ckpt)}
    import openai

    report["openai"] = openai.__version__
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the server
    deadline = start + args.budget_s - STOP_S
    with tempfile.TemporaryDirectory(prefix="omni-serve-check-") as tmp:
        first = None
        for placement in args.placements.split(","):
            left = deadline - time.monotonic()
            if first is not None and left < 1.2 * first:  # the next one needs at least as long as the first
                report[placement] = {"skipped": f"{left:.0f}s left; the first placement took {first:.0f}s"}
            else:
                began = time.monotonic()
                report[placement] = serve_once(placement, ckpt, Path(tmp), cpu, deadline)
                first = first or time.monotonic() - began
            emit(placement, report[placement])
    report["total_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
