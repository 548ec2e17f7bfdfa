"""Run `qwen_to_wan_i2v`: Qwen writes supplemental guidance for the prompt (streamed here as it is written),
the bridge merges it into the Wan prompt, and Wan2.2 renders the image into a video.

    python examples/qwen_to_wan_i2v.py                                  # SmolLM2 + the tiny demo Wan
    python examples/qwen_to_wan_i2v.py --ar-model ./models/Qwen2.5-0.5B-Instruct \
        --model ./models/Wan2.2-TI2V-5B-Diffusers --image photo.jpg --preset fast

With SmolLM2 the guidance usually parses and is merged into the Wan prompt; the tiny demo Qwen (when SmolLM2
is not fetched) writes noise, so the bridge falls back to the user's prompt. The trace says which.
"""

import argparse
import logging
import sys
from pathlib import Path

from omni_kernel import Omni, RequestFailed, RequestFinished, StageFinished, TokenDelta
from omni_kernel.core.trace import format_trace

IMAGE = Path(__file__).resolve().parent / "assets" / "image.png"


def main() -> int:
    parser = argparse.ArgumentParser(description="Qwen-guided image-to-video.")
    parser.add_argument("--ar-model", help="a local causal-LM directory (default: SmolLM2-135M-Instruct, else the "
                                           "tiny demo model)")
    parser.add_argument("--model", help="a local Wan2.2-TI2V-5B-Diffusers directory (default: the tiny demo model)")
    parser.add_argument("--image", default=str(IMAGE))
    parser.add_argument("--prompt", default="A lighthouse on a rocky coast at dusk, waves rolling in")
    parser.add_argument("--preset", help="quality, balanced, fast or smoke (default: smoke on the demo model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="out/qwen_to_wan_i2v.mp4")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("omni").setLevel(logging.INFO)

    config = {k: v for k, v in (("ar_model", args.ar_model), ("model", args.model)) if v}
    omni = Omni("qwen_to_wan_i2v", **config)
    # `seed` reaches both nodes; `preset` and `output` only the Wan node, which declares them
    events = omni.generate_stream(args.prompt, image=args.image, seed=args.seed, preset=args.preset,
                                  output=args.output)
    print("guidance from the AR stage: ", end="")
    for event in events:
        if isinstance(event, TokenDelta):
            print(event.text, end="", flush=True)
        elif isinstance(event, StageFinished) and event.node_id == "bridge":
            print()
        elif isinstance(event, RequestFinished):
            trace = event.result.trace
            print(f"bridge: parse_success={trace['diffusion.bridge_parse_success']} "
                  f"fallback_reason={trace['diffusion.bridge_fallback_reason']}")
            print(f"prompt seen by Wan: {trace['diffusion.prompt']!r}")
            print(f"wrote {event.result.path}")
            print(format_trace(trace))
        elif isinstance(event, RequestFailed):
            print(f"\nfailed: {event.error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
