"""A large video upload arriving slowly, beside chats: the server's RSS and a concurrent chat's latency.

Starts `omni serve --pipeline ar_text --pipeline wan_i2v` (the tiny demo checkpoints), measures a 4-token chat alone
(median of 7), then sends POST /v1/videos with a MB-sized `input_reference` file part (not an image: refused
once it has arrived, after the form is read) through a raw socket at RATE MB/s, while chats run back to back and
the server's VmRSS is sampled every 20 ms. Prints the figures; the same command measures any checkout of
omni_serve (put it first on PYTHONPATH). Usage:

    .venv/bin/python benchmarks/serve_upload.py [--mb 19.5] [--rate 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "omni_serve" / "tests"))
from serving import ServerProcess  # noqa: E402

CHAT = {"model": "ar_text", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Name a colour."}]}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def chat(http: httpx.Client) -> float:
    start = time.perf_counter()
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    return time.perf_counter() - start


def upload(port: int, size: int, rate: float) -> bytes:
    boundary = "omniboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na lighthouse\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwan_i2v\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"input_reference\"; filename=\"big.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    length = len(head) + size + len(tail)
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={boundary}"
                 f"\r\nContent-Length: {length}\r\n\r\n".encode() + head)
    chunk, sent, start = 64 * 1024, 0, time.monotonic()
    block = os.urandom(chunk)
    while sent < size:
        n = min(chunk, size - sent)
        sock.sendall(block[:n])
        sent += n
        delay = sent / (rate * 1e6) - (time.monotonic() - start)
        if delay > 0:
            time.sleep(delay)
    sock.sendall(tail)
    answer = sock.recv(4096)
    sock.close()
    return answer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=19.5, help="size of the file part, MB (10^6 bytes)")
    parser.add_argument("--rate", type=float, default=4.0, help="MB per second the client sends")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve-upload-"))
    server = ServerProcess(["--pipeline", "ar_text", "--pipeline", "wan_i2v", "--output-dir", str(tmp / "videos")],
                           tmp / "server.log").wait_ready()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for _ in range(3):
                chat(http)
            alone = statistics.median(chat(http) for _ in range(7))
            before = rss_mb(server.proc.pid)
            samples: list[float] = []
            answers: list[bytes] = []
            thread = threading.Thread(target=lambda: answers.append(upload(server.port, int(args.mb * 1e6),
                                                                           args.rate)))
            def sample():
                while thread.is_alive():
                    samples.append(rss_mb(server.proc.pid))
                    time.sleep(0.02)

            start = time.monotonic()
            thread.start()
            sampler = threading.Thread(target=sample)
            sampler.start()
            beside = []
            while thread.is_alive():
                beside.append(chat(http))
            took = time.monotonic() - start
            sampler.join()
            after = rss_mb(server.proc.pid)
        status = answers[0].split(b"\r\n", 1)[0].decode() if answers else "no answer"
        print(f"upload {args.mb:g} MB at {args.rate:g} MB/s: {took:.1f} s, answered {status!r}")
        print(f"RSS: {before:.0f} MB before, peak {max(samples + [after]):.0f} MB during "
              f"(+{max(samples + [after]) - before:.0f} MB), {after:.0f} MB after")
        print(f"4-token chat alone: median {alone * 1000:.0f} ms; beside the upload ({len(beside)} chats): median "
              f"{statistics.median(beside) * 1000:.0f} ms, max {max(beside) * 1000:.0f} ms")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
