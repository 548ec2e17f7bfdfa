"""Stream text from the `ar_text` pipeline: print each delta as it arrives, then the request's trace.

    python examples/ar_text_stream.py                                   # the default model (SmolLM2, or tiny)
    python examples/ar_text_stream.py --ar-model ./models/Qwen2.5-0.5B-Instruct --prompt "..."
"""

import argparse
import logging
import sys

from omni_kernel import Omni, RequestFailed, RequestFinished, TokenDelta
from omni_kernel.core.trace import format_trace


def main() -> int:
    parser = argparse.ArgumentParser(description="Stream text from the ar_text pipeline.")
    parser.add_argument("--ar-model", help="a local causal-LM directory (default: SmolLM2-135M-Instruct, else the "
                                           "tiny demo model)")
    parser.add_argument("--prompt", default="Describe a small school by the sea in three sentences.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("omni").setLevel(logging.INFO)  # says which default model runs

    omni = Omni("ar_text", **({"ar_model": args.ar_model} if args.ar_model else {}))
    params = {"temperature": args.temperature, "seed": args.seed, "max_tokens": args.max_tokens, "stream": True}
    for event in omni.generate_stream(args.prompt, **params):
        if isinstance(event, TokenDelta):
            print(event.text, end="", flush=True)
        elif isinstance(event, RequestFinished):
            print()
            print(format_trace(event.result.trace))
        elif isinstance(event, RequestFailed):
            print(f"\nfailed: {event.error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
