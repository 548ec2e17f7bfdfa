"""How often the qwen_to_wan_i2v bridge reads guidance from a real model, and why it falls back otherwise.

Runs the pipeline's AR node (`ar.prompt_bridge`, with its own policy: instruction, token budget) over 20
varied video prompts at once, greedy, and hands each output to the pipeline's connector (`ar_to_diffusion`),
exactly as qwen_to_wan_i2v does before Wan renders: the diffusion.bridge_* fields below are what a full run's
trace records (the video stage is left out; it does not influence the bridge). The last line is one JSON
object: parsed count, rate, how many parsed answers only copied text of the instruction (its placeholder or an
example), fallbacks by reason.

    .venv/bin/python benchmarks/bridge_rate.py                 # the real default model (SmolLM2, from the cache)
    .venv/bin/python benchmarks/bridge_rate.py --ar-model DIR --dtype fp32
    .venv/bin/python benchmarks/bridge_rate.py --unconstrained  # without the pipelines' guidance schema

The node's policy is the pipelines' own (omni_bridge.pipeline.BRIDGE_POLICY: output constrained to the guidance
schema) unless --unconstrained.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from omni_kernel import NodeSpec, Omni, PipelinePlan, Request, RequestFailed, RequestFinished  # noqa: E402
from omni_kernel.plugins import load_host  # noqa: E402

PROMPTS = (
    "A lighthouse on a rocky coast at dusk, waves rolling in, the camera slowly pushing forward",
    "A red fox trotting through fresh snow in a pine forest",
    "A busy night market in Taipei, steam rising from food stalls",
    "An astronaut floating inside a space station, looking out at Earth",
    "A golden retriever puppy chasing soap bubbles in a sunny garden",
    "Rain falling on a quiet Tokyo street, neon signs reflected in puddles",
    "A hot air balloon rising over the cappadocia valley at sunrise",
    "A chef flipping vegetables in a wok, flames leaping up",
    "Waves crashing against black volcanic sand on an Icelandic beach",
    "A ballerina spinning alone on a dark stage under a single spotlight",
    "A vintage train crossing a stone bridge in the mountains",
    "Close-up of coffee being poured into a white cup, slow motion",
    "A hummingbird hovering at a bright pink flower",
    "Children flying kites on a windy hill in spring",
    "A thunderstorm over a wheat field, lightning in the distance",
    "A koi pond with fish gliding under floating lotus leaves",
    "A city skyline time-lapse from day to night",
    "An old fisherman mending nets on a wooden dock at dawn",
    "A cat asleep on a windowsill while snow falls outside",
    "A skateboarder carving through an empty concrete bowl at golden hour",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ar-model", default=None, help="a local causal-LM directory (default: the default AR "
                                                         "model, which must be the real one: see --allow-tiny)")
    parser.add_argument("--dtype", default=None, help="ar_dtype (default: the checkpoint's)")
    parser.add_argument("--allow-tiny", action="store_true", help="measure the tiny random model if the real "
                                                                  "one is not in the cache")
    parser.add_argument("--show", action="store_true", help="print every model answer")
    parser.add_argument("--unconstrained", action="store_true", help="leave out the guidance schema (the node "
                                                                     "decodes freely, as before structured output)")
    return parser.parse_args()


def run_bridge(host, args) -> tuple[dict, dict, float]:
    """Every prompt through a one-node bridge pipeline at once: the requests, their outputs and the seconds."""
    from omni_bridge.pipeline import BRIDGE_POLICY

    # Unconstrained: the pipeline's answer format without its schema and budget (the node's own, 128 tokens).
    policy = {k: v for k, v in BRIDGE_POLICY.items() if k not in ("json_schema", "max_tokens")} if args.unconstrained \
        else BRIDGE_POLICY
    plan = PipelinePlan("bridge_rate", [NodeSpec("bridge", "ar.prompt_bridge", policy=policy, final=True)])
    config = {"ar_device": "cpu"}
    if args.ar_model:
        config["ar_model"] = args.ar_model
    if args.dtype:
        config["ar_dtype"] = args.dtype
    omni = Omni(plan, host=host, **config)
    requests = {f"p{i}": Request(plan.name, prompt, request_id=f"p{i}", params={"temperature": 0})
                for i, prompt in enumerate(PROMPTS)}
    start = time.perf_counter()
    outputs = {}
    for event in omni.run(requests.values()):
        if isinstance(event, RequestFailed):
            raise SystemExit(f"{event.request_id} failed: {event.error}")
        if isinstance(event, RequestFinished):
            outputs[event.request_id] = event.result.output
    return requests, outputs, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.ar_model is None and not args.allow_tiny:
        os.environ.setdefault("OMNI_AR_DEFAULT", "smollm2")
    host = load_host()
    connector = host.registry.connectors["ar_to_diffusion"].item
    requests, outputs, elapsed = run_bridge(host, args)
    from omni_bridge.guidance import ANSWER_PREFIX
    from omni_qwen import bridge_prompt

    # Text the model could copy instead of writing guidance: the instruction and its worked examples.
    given = bridge_prompt.bridge_prompt("", ANSWER_PREFIX)
    reasons: collections.Counter = collections.Counter()
    copied = 0
    model = None
    for rid, request in requests.items():
        output = outputs[rid]
        model = output.trace.get("ar.model")
        trace = connector.convert(output, request).trace
        reason = trace["diffusion.bridge_fallback_reason"]
        reasons[reason or "parsed"] += 1
        copied += reason is None and trace["diffusion.ar_guidance_prompt"] in given
        tokens = output.trace["ar.output_tokens"]
        outcome = f"guidance: {trace['diffusion.ar_guidance_prompt']}" if reason is None else f"fallback {reason}"
        print(f"{rid:>3} {tokens:>3} tokens  {outcome}", file=sys.stderr)
        if args.show or reason is not None:
            print(f"      answer: {output.text!r}", file=sys.stderr)
    parsed = reasons.pop("parsed", 0)
    print(json.dumps({"benchmark": "bridge_rate", "model": model, "constrained": not args.unconstrained,
                      "prompts": len(PROMPTS), "parsed": parsed,
                      "parse_rate": round(parsed / len(PROMPTS), 3),
                      "parsed_but_copied_from_instruction": copied, "fallback_reasons": dict(sorted(reasons.items())),
                      "elapsed_s": round(elapsed, 1)}))


if __name__ == "__main__":
    main()
