"""Per-phase wall times of one request: trace fields, a short table, and a Chrome trace-event JSON."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import attrs

from omni_kernel.util.files import write_json

PHASES = ("load", "text_encode", "image_prepare", "latents", "denoise", "vae_decode", "export")


@attrs.frozen
class Span:
    name: str
    start: float  # seconds since the request started
    duration: float
    args: dict = attrs.field(factory=dict)


@attrs.define
class Profiler:
    sync: object = None  # called before a span closes so GPU work is counted where it ran
    origin: float = attrs.Factory(time.perf_counter)
    spans: list[Span] = attrs.Factory(list)

    @contextmanager
    def span(self, name: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            end = time.perf_counter()
            self.spans.append(Span(name, start - self.origin, end - start, args))

    def add(self, name: str, duration_s: float, **args) -> None:
        """Record a span measured elsewhere (the model load), ending now."""
        now = time.perf_counter() - self.origin
        self.spans.append(Span(name, max(0.0, now - duration_s), duration_s, args))

    def record(self, name: str, start: float, end: float, **args) -> None:
        """Record a span timed elsewhere (perf_counter values): one batched step shared by several requests."""
        self.spans.append(Span(name, start - self.origin, end - start, args))

    def phase_ms(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for span in self.spans:
            phase = span.name.split(":")[0]
            totals[phase] = totals.get(phase, 0.0) + span.duration * 1000
        return {p: round(totals[p], 3) for p in PHASES if p in totals}

    def step_ms(self) -> list[float]:
        return [round(s.duration * 1000, 3) for s in self.spans if s.name.startswith("denoise:")]

    def trace(self, detailed: bool) -> dict:
        fields = {f"diffusion.{phase}_ms": ms for phase, ms in self.phase_ms().items()}
        if detailed:
            fields["diffusion.denoise_steps_ms"] = self.step_ms()
        return fields

    def table(self) -> str:
        phases = self.phase_ms()
        total = sum(phases.values()) or 1.0
        steps = self.step_ms()
        lines = [f"{'phase':<14}{'ms':>12}{'share':>8}"]
        for phase, ms in phases.items():
            extra = f"  ({len(steps)} steps, {ms / len(steps):.1f} ms/step)" if phase == "denoise" and steps else ""
            lines.append(f"{phase:<14}{ms:>12.1f}{ms / total:>8.1%}{extra}")
        lines.append(f"{'total':<14}{total:>12.1f}")
        return "\n".join(lines)

    def chrome_trace(self, request_id: str) -> dict:
        events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "omni diffusion"}},
                  {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": request_id}}]
        for span in self.spans:
            events.append({"name": span.name, "cat": span.name.split(":")[0], "ph": "X", "pid": 1, "tid": 1,
                           "ts": round(span.start * 1e6, 3), "dur": round(span.duration * 1e6, 3),
                           "args": span.args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: Path, request_id: str) -> Path:
        return write_json(path, self.chrome_trace(request_id), indent=None)


def profile_path(output: Path) -> Path:
    """out.mp4 -> out.trace.json, next to the video."""
    return output.with_name(output.stem + ".trace.json")
