"""An identity AR executor that streams its prompt back token by token, and the kernel's `echo` pipeline.

It runs the full layering (StageScheduler -> Stage -> Engine -> RequestScheduler -> ModelRunner -> Executor)
with no model, so the kernel's own tests need no torch.
"""

from __future__ import annotations

import re
import time

import attrs

from .engine import Engine
from .errors import InvalidParameter
from .events import StageFinished, TokenDelta
from .graph import NodeSpec, PipelinePlan
from .hookspecs import hookimpl
from .registry import NodeType
from .request import StageInput, StageOutput
from .runner import ModelRunner
from .scheduler import RequestScheduler, SchedulerOutput
from .stage import Stage

_TOKEN = re.compile(r"\s*\S+|\s+")


class IdentityARPipeline:
    """The "model": tokens are words with their leading whitespace; the output is the prompt itself."""

    def tokenize(self, text: str) -> list[str]:
        return _TOKEN.findall(text)


@attrs.define
class _Sequence:
    item: StageInput
    tokens: list[str]
    max_tokens: int
    start: float
    emitted: int = 0
    first_token_ms: float | None = None


class IdentityARExecutor:
    def __init__(self, node_id: str, pipeline: IdentityARPipeline | None = None):
        self.node_id = node_id
        self.pipeline = pipeline or IdentityARPipeline()
        self.sequences: dict[str, _Sequence] = {}

    def add_request(self, item: StageInput) -> None:
        if not item.prompt:
            raise InvalidParameter("prompt", "must not be empty")
        tokens = self.pipeline.tokenize(item.prompt)
        budget = getattr(item.params, "max_tokens", None) or len(tokens)
        self.sequences[item.request_id] = _Sequence(item, tokens, budget, time.perf_counter())

    def execute(self, batch: SchedulerOutput) -> list:
        events = []
        for rid in batch.request_ids:
            seq = self.sequences[rid]
            token = seq.tokens[seq.emitted]
            seq.emitted += 1
            if seq.first_token_ms is None:
                seq.first_token_ms = (time.perf_counter() - seq.start) * 1000
            events.append(TokenDelta(rid, self.node_id, token))
            if seq.emitted == len(seq.tokens) or seq.emitted >= seq.max_tokens:
                events.append(StageFinished(rid, self.node_id, self._output(seq)))
        return events

    def free(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)

    def _output(self, seq: _Sequence) -> StageOutput:
        stop = "eos" if seq.emitted == len(seq.tokens) else "max_tokens"
        trace = {"ar.input_tokens": len(seq.tokens), "ar.output_tokens": seq.emitted,
                 "ar.generated_tokens": seq.emitted, "ar.ttft_ms": round(seq.first_token_ms, 3),
                 "ar.stop_reason": stop, "ar.streaming": bool(seq.item.options.get("stream")),
                 "ar.prompt_mode": "raw", "ar.kv_cache": False, "ar.kv_cache_backend": "none"}
        return StageOutput(seq.item.request_id, self.node_id, text="".join(seq.tokens[: seq.emitted]),
                           stop_reason=stop, trace=trace)


def build_echo_stage(node: NodeSpec, config) -> Stage:
    executor = IdentityARExecutor(node.id)
    return Stage(node, "ar", Engine(RequestScheduler(), ModelRunner(executor, node.id)))


ECHO_NODE = NodeType("kernel.echo", "ar", build_echo_stage, options={"stream"},
                     description="streams the prompt back word by word (no model)")
ECHO_PIPELINE = PipelinePlan("echo", [NodeSpec("echo", "kernel.echo", final=True)],
                             description="the prompt, streamed back by the identity AR executor")


class KernelPlugin:
    """The kernel registers its own echo pipeline through the same hooks as any plugin."""

    @hookimpl
    def omni_register_node_types(self, register):
        register(ECHO_NODE)

    @hookimpl
    def omni_register_pipelines(self, register):
        register(ECHO_PIPELINE)
