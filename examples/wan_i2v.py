"""Render an image into a video with the `wan_i2v` pipeline (Wan2.2 TI2V-5B), then print the trace.

    python examples/wan_i2v.py                                          # the tiny demo model, smoke preset
    python examples/wan_i2v.py --model ./models/Wan2.2-TI2V-5B-Diffusers --image photo.jpg --preset fast
"""

import argparse
import logging
from pathlib import Path

from omni_kernel import Omni
from omni_kernel.core.trace import format_trace

IMAGE = Path(__file__).resolve().parent / "assets" / "image.png"


def main() -> None:
    parser = argparse.ArgumentParser(description="Image-to-video with the wan_i2v pipeline.")
    parser.add_argument("--model", help="a local Wan2.2-TI2V-5B-Diffusers directory (default: the tiny demo model)")
    parser.add_argument("--image", default=str(IMAGE))
    parser.add_argument("--prompt", default="The camera slowly pushes in while waves roll onto the shore")
    parser.add_argument("--preset", help="quality, balanced, fast or smoke (default: smoke on the demo model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="out/wan_i2v.mp4")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("omni").setLevel(logging.INFO)

    omni = Omni("wan_i2v", **({"model": args.model} if args.model else {}))
    result = omni.generate(args.prompt, image=args.image, preset=args.preset, seed=args.seed, output=args.output)
    print(f"wrote {result.path}")
    print(format_trace(result.trace))


if __name__ == "__main__":
    main()
