"""A fake plugin for the stage-worker tests: importable by name in a spawned worker (no torch, no model).

`fake_slow` is `words` (kind "ar", streams the prompt word by word) -> `render` (kind "video", one output with
the word count), each step sleeping `policy["sleep_ms"]`; `fake_video` is `render` alone (its entry stage, with
`concurrent_inputs` on). A prompt with "crash" kills the worker process in a
step, "explode" makes the `words` scheduler raise at its second step (its engine is then dead), "bad" is refused
by input processing, "frames" makes `render` return a numpy array in `data`, a word
"hold=PATH" makes a `render` step create PATH.started, then wait until PATH exists, and "unsendable_input" /
"unsendable_output" / "unsendable_handoff" put a lock (which cannot be pickled) in the trace of `words`' processed
input / `render`'s output / the connector's input for `render`; "unreadable_handoff" puts there an object only the
front can unpickle; "unreadable_input" / "unreadable_output" put an object only the worker can unpickle in the trace
of `words`' processed input / `render`'s output, "big_input" / "big_handoff" put a 1 MiB array in `words`' processed
input / the connector's input for `render` (whose output trace says its sum and whether it was mapped from shared
memory), and "lost_frames" gives `render`'s output a shared-memory array that never arrives. The config
`fake_build_gate=PATH` makes a worker's build wait while PATH exists (a slow model load, e.g. of a restart). Each
stage's output trace has the thread count its worker set for each of its steps (`words.threads`, `render.threads`;
shared cores). `fake_listen` is one `listen` node (kind "asr") that reads the request's audio (a path or bytes) and
answers with its size, its digest and the worker's pid.

Streams and joins (with tests/kernel_fakes.py's connectors and join): `fake_spoken` is `words` -> `say` on a streaming
edge (each word is a chunk; `say`, kind "say", speaks chunk k at its step k as an AudioDelta and answers with the
words upper-cased and the sound; both are outputs); `fake_narrated` is `words` -> `render` and `words` -> `say`
(streamed), joined by `mux` (inputs "video" and "voice"). A `say` chunk with "boom" is refused by its input processor.
A word "gate=PATH" makes its `words` step create PATH.started, then wait until PATH exists. Each engine's stats count
the requests its runner holds and the steps it ran (`fake.live`, `fake.steps`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import attrs

from omni_kernel import hookimpl
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InputError, InvalidParameter, ModelError
from omni_kernel.core.graph import EdgeSpec, NodeSpec, PipelinePlan
from omni_kernel.core.params import option
from omni_kernel.core.registry import NodeType
from omni_kernel.core.request import StageInput, StageOutput, StreamChunk
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Outputs, Stage
from omni_kernel.events import AudioDelta, StageFinished, TokenDelta
from omni_kernel.plugins import PluginHost
from omni_kernel.testing import wait_until
from omni_workers import WorkersPlugin, shared
from omni_workers.cores import step_threads

sys.path.insert(0, str(Path(__file__).parents[3] / "tests"))  # the kernel's fakes; a worker gets the front's path
from kernel_fakes import StreamTagConnector, TagConnector, fake_node_type, text_join  # noqa: E402

log = logging.getLogger("omni")


def in_memory_file(address: int) -> bool:
    """`address` lies in a mapping of one of omni's shared memory files (omni_workers/shared.py)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "memfd:omni-array" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


class LostArray:
    """Pickles as a shared-memory array (shared.py) whose memory file was never sent."""

    def __reduce__(self):
        return shared._attach, ("no-such-token", 96, False, "float32", (2, 3, 4))


@attrs.frozen
class FakeConfig:
    fake_fail_build: bool = option(False, help="the factory raises ModelError", type=bool)
    fake_build_gate: str = option("", help="while this file exists, the factory waits (a model load)")


@attrs.frozen
class FakeParams:
    fake_steps: int = option(0, help="steps of the render node (0: one per word)", type=int)


class SleepyRunner:
    """Step k of a request returns `pieces(item)[k]` after sleeping; the request's record keeps the worker's thread
    count at each of its steps (`state`). A prompt with "background" (with `background`) returns its last step as
    a Future done 0.3 s later, as if exported on a thread (Wan's MP4): the scheduler holds it until then."""

    def __init__(self, sleep_s: float, pieces, hold: bool = False, background: bool = False, gates: bool = False):
        self.sleep_s = sleep_s
        self.pieces = pieces
        self.hold = hold
        self.background = background
        self.gates = gates  # a piece "gate=PATH" waits for PATH
        self.live: set[str] = set()  # the requests it holds: its model state
        self.steps = 0  # request steps run

    def add_request(self, record) -> None:
        record.state = []
        self.live.add(record.request_id)

    def run(self, batch) -> dict:
        for job in batch.records:
            job.state.append(step_threads())
        time.sleep(self.sleep_s)
        for job in batch.records if self.hold else ():
            for word in job.item.prompt.split(" "):
                if word.startswith("hold="):
                    _wait_for(Path(word[5:]))
        out = {}
        for job, step in zip(batch.records, batch.steps):
            item = job.item
            if "crash" in item.prompt:
                os.kill(os.getpid(), signal.SIGKILL)
            out[job.request_id] = piece = self.pieces(item)[step]
            if self.gates and piece.startswith("gate="):
                _wait_for(Path(piece[5:]))
            if self.background and "background" in item.prompt and step == job.total - 1:
                out[job.request_id] = future = Future()
                threading.Timer(0.3, future.set_result, [None]).start()
        self.steps += len(batch.records)
        return out

    def free(self, record) -> None:
        self.live.discard(record.request_id)

    def stats(self) -> dict:
        return {"fake.live": len(self.live), "fake.steps": self.steps}


def _wait_for(gate: Path) -> None:
    gate.with_suffix(".started").touch()
    wait_until(gate.exists, 120, f"the test to open the gate {gate}")


class WordsScheduler(StepScheduler):
    def schedule(self):
        if any("explode" in job.item.prompt and job.step >= 1 for job in self.queue):
            raise RuntimeError("injected scheduler fault")
        return super().schedule()


class WordsInputs:
    concurrent = False

    def check(self, item: StageInput) -> None:
        pass

    def process(self, item: StageInput) -> StageInput:
        if "bad" in item.prompt:
            raise InvalidParameter("prompt", "contains bad")
        trace = {"words.pid": os.getpid()}
        if "unsendable_input" in item.prompt:
            trace["words.lock"] = threading.Lock()
        if "unreadable_input" in item.prompt:
            trace["words.worker_only"] = WorkerOnly()
        if "big_input" in item.prompt:  # 1 MiB: the answer to `process` crosses through shared memory
            import numpy as np

            trace["words.big"] = np.arange(2 ** 18, dtype=np.float32)
        return attrs.evolve(item, processed=tuple(item.prompt.split(" ")), trace=trace)


class WordsOutputs(Outputs):
    def process(self, outputs) -> tuple[list, list[str]]:
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            events.append(TokenDelta(out.request_id, self.node_id, out.result + " "))
            if out.finished:
                events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                    out.request_id, self.node_id, text=" ".join(out.item.processed), stop_reason="done",
                    trace={"words.pid": os.getpid(), "words.threads": out.record.state})))
        return events, []


class RenderInputs:
    """Only counts words, so it may run beside a step: `policy["concurrent_inputs"]` says so (as Wan's does)."""

    def __init__(self, concurrent: bool):
        self.concurrent = concurrent

    def check(self, item: StageInput) -> None:
        pass

    def process(self, item: StageInput) -> StageInput:
        return attrs.evolve(item, processed=len(item.prompt.split(" ")))


class RenderOutputs(Outputs):
    """One output per request. The trace counts the stage's steps that had nothing to report
    (`render.idle_steps`): a stage with only background work left is waited on, not stepped in a loop."""

    def __init__(self, node_id: str):
        super().__init__(node_id)
        self.idle_steps = 0

    def process(self, outputs) -> tuple[list, list[str]]:
        self.idle_steps += not outputs
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None and o.finished):
            item = out.item
            data = None
            if "frames" in item.prompt:
                import numpy as np

                size = 2 ** 18 if "big" in item.prompt else 24  # 1 MiB: shared memory; 96 bytes: in the pickle
                data = {"frames": np.arange(size, dtype=np.float32).reshape(2, -1, 4)}
            if "lost_frames" in item.prompt:
                data = {"frames": LostArray()}
            text = f"rendered {item.processed} words" + (" in the background" if "background" in item.prompt else "")
            trace = {"render.pid": os.getpid(), "render.threads": out.record.state}
            if "background" in item.prompt:
                trace["render.idle_steps"] = self.idle_steps
            if "big_handoff" in item.prompt:
                embeds = item.trace["fake.embeds"]
                trace["render.embeds_sum"] = float(embeds.sum())
                trace["render.embeds_mapped"] = in_memory_file(embeds.ctypes.data)
            if "unsendable_output" in item.prompt:
                trace["render.lock"] = threading.Lock()
            if "unreadable_output" in item.prompt:
                trace["render.worker_only"] = WorkerOnly()
            events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                out.request_id, self.node_id, text=text, data=data, trace=trace)))
        return events, []


@attrs.frozen
class FakePolicy:
    sleep_ms: float = option(0.0, help="each step sleeps this long", type=float)
    concurrent_inputs: bool = option(False, help="the render stage's inputs may be processed beside a step",
                                      type=bool)


@attrs.frozen(eq=False)
class Own:
    """An engine setting compared by identity: a node of this settings' gets an engine of its own."""


@attrs.frozen
class FakeEngineSettings:
    config: FakeConfig
    sleep_ms: float
    owner: object = None  # an Own: this node's own engine; None: every node of this config and policy shares one


def _load(config: FakeConfig) -> None:
    """A model load as long as the test wants: while the gate file exists (a failed build after 60 s)."""
    if config.fake_build_gate:
        wait_until(lambda: not os.path.exists(config.fake_build_gate), 60,
                   f"the test to remove the build gate {config.fake_build_gate}", interval=0.02)


def build_words_engine(settings: FakeEngineSettings) -> Engine:
    log.info("loading the fake words model")
    _load(settings.config)
    if settings.config.fake_fail_build:
        raise ModelError("the fake model is missing")
    runner = SleepyRunner(settings.sleep_ms / 1000, lambda item: item.processed, gates=True)
    scheduler = WordsScheduler(max_batch=8, num_steps=lambda item: len(item.processed), model_stats=runner.stats)
    return Engine(scheduler, runner)


def render_steps(item) -> int:
    return item.params.fake_steps or item.processed


def build_render_engine(settings: FakeEngineSettings) -> Engine:
    log.info("loading the fake render model")
    _load(settings.config)
    runner = SleepyRunner(settings.sleep_ms / 1000, lambda item: [None] * render_steps(item), hold=True,
                          background=True)
    return Engine(StepScheduler(max_batch=8, num_steps=render_steps, model_stats=runner.stats), runner)


class SayInputs:
    """A streamed input: its processed input is the chunks so far, one step each (a whole input: its words)."""

    concurrent = False

    def check(self, item: StageInput) -> None:
        pass

    def process(self, item: StageInput) -> StageInput:
        return attrs.evolve(item, processed=() if item.stream else tuple(w + " " for w in item.prompt.split()))

    def extend(self, item: StageInput, chunk: StreamChunk) -> StageInput:
        if "boom" in chunk.text:
            raise InputError(f"cannot say {chunk.text!r}")
        return attrs.evolve(item, processed=item.processed + ((chunk.text,) if chunk.text else ()))


def spoken(piece: str) -> bytes:
    """A piece's fake sound: its upper-cased text as 16-bit samples."""
    return b"".join(code.to_bytes(2, "little") for code in piece.upper().encode())


class SayOutputs(Outputs):
    """Each step's piece as an AudioDelta; at the end the pieces upper-cased, and the whole sound in `data`."""

    def process(self, outputs) -> tuple[list, list[str]]:
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            if out.result is not None:
                events.append(AudioDelta(out.request_id, self.node_id, spoken(out.result), 16000, out.result))
            if out.finished:
                text = "".join(out.item.processed)
                events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                    out.request_id, self.node_id, text=text.upper(), stop_reason="done", data={"pcm": spoken(text)},
                    trace={"say.pid": os.getpid(), "say.chunks": len(out.item.processed)})))
        return events, []


def build_say_engine(settings: FakeEngineSettings) -> Engine:
    runner = SleepyRunner(settings.sleep_ms / 1000, lambda item: item.processed)
    scheduler = StepScheduler(max_batch=8, num_steps=lambda item: len(item.processed), model_stats=runner.stats)
    return Engine(scheduler, runner)


def build_say(node: NodeSpec, config, policy: FakePolicy, settings, engine: Engine) -> Stage:
    return Stage(node, "say", SayInputs(), engine, SayOutputs(node.id))


def build_words(node: NodeSpec, config, policy: FakePolicy, settings, engine: Engine) -> Stage:
    return Stage(node, "ar", WordsInputs(), engine, WordsOutputs(node.id))


def build_render(node: NodeSpec, config, policy: FakePolicy, settings, engine: Engine) -> Stage:
    return Stage(node, "video", RenderInputs(policy.concurrent_inputs), engine, RenderOutputs(node.id))


class FrontOnly:
    """Pickled in the front, cannot be unpickled in a worker (as an object of a class only the front has)."""

    def __init__(self):
        self.pid = os.getpid()

    def __reduce__(self):
        return _front_only, (self.pid,)


def _front_only(pid: int) -> FrontOnly:
    if os.getpid() != pid:
        raise ImportError("FrontOnly exists only in the front")
    return FrontOnly()


class WorkerOnly:
    """Pickled in the process that made it (a worker), cannot be unpickled anywhere else (as an object of a class
    only the worker has)."""

    def __init__(self, pid: int | None = None):
        self.pid = pid or os.getpid()

    def __reduce__(self):
        return _worker_only, (self.pid,)


def _worker_only(pid: int) -> WorkerOnly:
    if os.getpid() != pid:
        raise ImportError("WorkerOnly exists only in the worker")
    return WorkerOnly(pid)


@attrs.frozen
class WordsToRender:
    name: str = "fake_words_to_render"
    source_kind: str = "ar"
    target_kind: str = "video"

    def convert(self, output: StageOutput, request) -> StageInput:
        trace = {"fake.connector_pid": os.getpid()}
        if "unsendable_handoff" in output.text:
            trace["fake.lock"] = threading.Lock()
        if "unreadable_handoff" in output.text:
            trace["fake.front_only"] = FrontOnly()
        if "big_handoff" in output.text:  # 1 MiB: crosses to the worker through shared memory
            import numpy as np

            trace["fake.embeds"] = np.arange(2 ** 18, dtype=np.float32)
        return StageInput(request.request_id, output.text, trace=trace)


def stream_plans(sleep_ms: float) -> list[PipelinePlan]:
    """`fake_spoken` and `fake_narrated` (see the module docstring)."""
    policy = {"sleep_ms": sleep_ms}
    words = NodeSpec("words", "fake.words", policy=policy)
    say = NodeSpec("say", "fake.say", policy=policy)
    to_say = EdgeSpec("words", "say", "fake_words_to_say", stream=True)
    return [PipelinePlan("fake_spoken", [attrs.evolve(words, final=True), attrs.evolve(say, final=True)], [to_say]),
            PipelinePlan("fake_narrated", [words, NodeSpec("render", "fake.render", policy=policy), say,
                                           NodeSpec("mux", "fake.mux", final=True)],
                         [EdgeSpec("words", "render", "fake_words_to_render"), to_say,
                          EdgeSpec("render", "mux", "fake_render_to_mux", input="video"),
                          EdgeSpec("say", "mux", "fake_say_to_mux", input="voice")])]


def plan(sleep_ms: float = 0, words_placement: str | None = None) -> PipelinePlan:
    policy = {"sleep_ms": sleep_ms}
    return PipelinePlan("fake_slow", [NodeSpec("words", "fake.words", policy=policy, placement=words_placement),
                                      NodeSpec("render", "fake.render", policy=policy, final=True)],
                        [EdgeSpec("words", "render", "fake_words_to_render")])


class ListenRunner:
    """The audio input's size and digest, as the worker saw it, in one step."""

    def add_request(self, record) -> None:
        audio = record.item.audio
        data = audio if isinstance(audio, bytes) else Path(audio).read_bytes()
        record.state = f"{len(data)} {hashlib.sha256(data).hexdigest()[:8]} {os.getpid()}"

    def run(self, batch) -> dict:
        return {job.request_id: job.state for job in batch.records}

    def free(self, record) -> None:
        pass


def build_listen_engine(settings) -> Engine:
    return Engine(StepScheduler(max_batch=8, num_steps=lambda item: 1), ListenRunner())


def build_listen(node: NodeSpec, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "asr", None, engine)


class FakePlugin:
    """`shared`: nodes of one type, config and policy share one engine (in one worker, under placement process),
    whichever graph of the host they are in; otherwise every node has an engine of its own."""

    def __init__(self, sleep_ms: float = 0, words_placement: str | None = None, shared: bool = False):
        self.plan = plan(sleep_ms, words_placement)
        self.shared = shared

    def engine_settings(self, node: NodeSpec, config: FakeConfig | None, policy: FakePolicy) -> FakeEngineSettings:
        return FakeEngineSettings(config or FakeConfig(), policy.sleep_ms, None if self.shared else Own())

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("fake.words", "ar", engine_settings=self.engine_settings, engine=build_words_engine,
                          stage=build_words, config=FakeConfig, params=FakeParams, policy=FakePolicy))
        register(NodeType("fake.render", "video", engine_settings=self.engine_settings, engine=build_render_engine,
                          stage=build_render, config=FakeConfig, params=FakeParams, policy=FakePolicy))
        register(NodeType("fake.listen", "asr", engine_settings=lambda node, config, policy: node.id,
                          engine=build_listen_engine, stage=build_listen, inputs={"audio"}))
        register(NodeType("fake.say", "say", engine_settings=self.engine_settings, engine=build_say_engine,
                          stage=build_say, config=FakeConfig, params=FakeParams, policy=FakePolicy, stream_input=True))
        register(fake_node_type("fake.mux", "mux", [], join=text_join("video", "voice")))

    @hookimpl
    def omni_register_connectors(self, register):
        register(WordsToRender())
        register(StreamTagConnector("fake_words_to_say", "ar", "say"))
        register(TagConnector("fake_render_to_mux", "video", "mux"))
        register(TagConnector("fake_say_to_mux", "say", "mux"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(self.plan)
        policy = {"concurrent_inputs": True, "sleep_ms": self.plan.nodes[0].policy["sleep_ms"]}
        register(PipelinePlan("fake_video", [NodeSpec("render", "fake.render", policy=policy, final=True)]))
        register(PipelinePlan("fake_listen", [NodeSpec("listen", "fake.listen", final=True)]))
        for streamed in stream_plans(self.plan.nodes[0].policy["sleep_ms"]):
            register(streamed)


def make_host(sleep_ms: float = 0, words_placement: str | None = None, shared: bool = False) -> PluginHost:
    """The kernel's plugin, the fake one and omni-workers (the placements); picklable as
    `partial(make_host, ...)` for a worker's rebuild. `shared`: both fake node types give one share key, so one
    worker hosts every fake stage of the host."""
    from functools import partial

    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(FakePlugin(sleep_ms, words_placement, shared), "fake")
    host.register(WorkersPlugin(), "omni_workers")
    host.rebuild = partial(make_host, sleep_ms, words_placement, shared)
    return host
