"""The summary of one scripts/device_check.sh run (torch-free): OUT/summary.json and a table on stdout.

    python3 benchmarks/device_summary.py OUT PARTS_FILE

PARTS_FILE holds one line per part: `name rc seconds timeout`. Each part's log is OUT/name.log; its result is the
last JSON object printed there, or, when the part died or ran out of time before printing it, the JSON lines of
the sections it finished (`partial`). `figures` are the rows of docs/gpu.md's "Measured on a GPU" table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (row of docs/gpu.md, part, path into its result: a segment "*" takes the worst value over that level; "a|b": a,
# else b)
FIGURES = [
    ("AR greedy = HF generate, fp32 paged", "ar", "greedy.fp32_paged.all_equal"),
    ("AR greedy = HF generate, fp32 dynamic_cache", "ar", "greedy.fp32_dynamic_cache.all_equal"),
    ("AR greedy = HF generate, bf16 paged", "ar", "greedy.bf16_paged.all_equal"),
    ("AR greedy = HF generate, bf16 dynamic_cache", "ar", "greedy.bf16_dynamic_cache.all_equal"),
    ("AR bf16 paged: shortest matching prefix (of 32)", "ar", "greedy.bf16_paged.requests.*.matching_prefix"),
    ("AR KV pool line (bf16, default size)", "ar", "greedy.bf16_paged.kv_pool"),
    ("AR runtime tok/s (ar_serving workload, bf16)", "ar", "throughput.runtime_tok_s"),
    ("AR HF generate one at a time tok/s", "ar", "throughput.hf_sequential_tok_s"),
    ("AR HF generate static batches of 32 tok/s", "ar", "throughput.hf_static_tok_s"),
    ("AR runtime / HF one at a time (vLLM: 14-24x)", "ar", "throughput.ratio_vs_sequential"),
    ("AR runtime / HF static batches", "ar", "throughput.ratio_vs_static"),
    ("serve: startup s (inproc)", "serve", "inproc.startup_s"),
    ("serve: streamed chat TTFT s", "serve", "inproc.chat_stream.ttft_s"),
    ("serve: streamed = unstreamed text", "serve", "inproc.chat_stream.same_as_unstreamed"),
    ("serve: wan_i2v video job s", "serve", "inproc.video.seconds"),
    ("serve: qwen_to_wan_i2v video job s", "serve", "inproc.bridge_video.seconds"),
    ("serve: chat TTFT s during a video job", "serve", "inproc.chat_during_video.chat_ttft_s"),
    ("serve: exit status after SIGTERM", "serve", "inproc.exit_code"),
    ("serve --placement process: chat TTFT s during a video job", "serve",
     "process.chat_during_video.chat_ttft_s"),
    ("Wan request s, offload on", "wan", "placements.model_cpu_offload.request_s|model_cpu_offload.request_s"),
    ("Wan request s, offload off", "wan", "placements.off.request_s|off.request_s"),
    ("Wan frames vs CPU fp32, max abs diff (offload off)", "wan",
     "placements.off.max_abs_diff_vs_cpu|off.max_abs_diff_vs_cpu"),
    ("Wan offload on vs off, max abs diff", "wan", "offload_on_vs_off"),
    ("Wan batched vs solo, max abs diff", "wan", "batched_vs_solo.max_abs_diff.*"),
    ("Wan text K/V vs stock cross-attention, max abs diff", "wan", "text_kv_vs_stock.max_abs_diff"),
    ("Wan text-to-video", "wan", "t2v"),
    ("Wan continuous batching / sequential", "wan_batching", "ratio_vs_sequential|base.ratio_vs_sequential"),
    ("Wan continuous batching / static", "wan_batching", "ratio_vs_static|base.ratio_vs_static"),
    ("Wan continuous batching / sequential, 4x the tokens", "wan_batching", "large.ratio_vs_sequential"),
    ("Wan step cache: skipped share of forwards", "step_cache", "skipped_share"),
    ("Wan step cache: cached / uncached batch speed", "step_cache", "ratio"),
    ("Wan step cache: of the ideal ratio", "step_cache", "of_ideal"),
]


def json_lines(text: str) -> list[dict]:
    """Each line that is a JSON object, or `label: {...}` (read as {label: {...}})."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        label, sep, rest = line.partition(": ")
        if not line.startswith("{") and sep and label.isidentifier() and rest.startswith("{"):
            line = "{" + json.dumps(label) + ": " + rest + "}"
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                out.append(value)
    return out


def result_of(log: str) -> tuple[dict | None, dict]:
    """(the final JSON object, or None; the sections printed before it, merged)."""
    lines = json_lines(log)
    final = next((v for v in reversed(lines) if "check" in v or "benchmark" in v), None)
    partial: dict = {}
    for value in lines:
        if value is not final and len(value) == 1:
            partial.update(value)
    return final, partial


def lookup(value, path: list[str]):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if head == "*" and isinstance(value, dict):
        found = [lookup(v, rest) for v in value.values()]
        found = [f for f in found if f is not None]
        if not found:
            return None
        if all(isinstance(f, bool) for f in found):
            return all(found)
        numbers = [f for f in found if isinstance(f, (int, float))]
        if not numbers:
            return found[0]
        return min(numbers) if "matching_prefix" in rest else max(numbers)
    if isinstance(value, dict) and head in value:
        return lookup(value[head], rest)
    return None


def main() -> None:
    out, parts_file = Path(sys.argv[1]), Path(sys.argv[2])
    summary: dict = {"parts": {}, "figures": {}}
    env = out / "env.txt"
    if env.is_file():
        summary["env"] = env.read_text(errors="replace").splitlines()[:12]
    results = {}
    for line in parts_file.read_text().splitlines():
        name, rc, seconds, limit = line.split()
        log_path = out / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        final, partial = result_of(log)
        status = "ok" if rc == "0" and final is not None else "timeout" if rc in ("124", "137") else "failed"
        part = {"status": status, "rc": int(rc), "seconds": int(seconds), "timeout_s": int(limit)}
        if final is None:
            part["partial"] = partial
        if status != "ok":
            part["log_tail"] = log.splitlines()[-15:]
        results[name] = final if final is not None else partial
        summary["parts"][name] = part
    for label, name, paths in FIGURES:
        found = (lookup(results.get(name) or {}, path.split(".")) for path in paths.split("|"))
        summary["figures"][label] = next((v for v in found if v is not None), None)
    summary["results"] = results
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, part in summary["parts"].items():
        print(f"{name:14} {part['status']:8} rc={part['rc']:<4} {part['seconds']:>4}s of {part['timeout_s']}s")
    for label, value in summary["figures"].items():
        print(f"  {label}: {value}")


if __name__ == "__main__":
    main()
