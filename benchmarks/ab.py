"""Old code against new code, side by side: one benchmark command run alternately (A B A B ...) in two checkouts
of this repository, each in a fresh interpreter, and the median of each figure of its final JSON line.

    python benchmarks/ab.py --old ../wt-old --rounds 3 -- benchmarks/wan_i2v.py --steps 2 --repeats 1

Both sides run the command from their own checkout (its benchmark script and its code, through PYTHONPATH), with
the same interpreter and environment; so a machine that slows down mid-run hurts both alike. The last line is
JSON: each numeric figure's medians and the ratio new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [".", "plugins/omni_hf", "plugins/omni_qwen", "plugins/omni_wan", "plugins/omni_bridge",
            "plugins/omni_serve", "plugins/omni_workers", "examples/plugin_example"]


def run(tree: Path, command: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(tree / p) for p in PACKAGES if (tree / p).is_dir()))
    proc = subprocess.run([sys.executable, *command], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: {' '.join(command)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def numbers(figures: dict, prefix: str = "") -> dict[str, float]:
    found = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            found.update(numbers(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[prefix + key] = float(value)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--new", type=Path, default=ROOT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            figures = numbers(run(getattr(args, side), command, args.timeout))
            runs[side].append(figures)
            print(f"round {i} {side}: {json.dumps(figures)}", flush=True)
    keys = sorted(set(runs["old"][0]) & set(runs["new"][0]))
    report = {}
    for key in keys:
        old = statistics.median(r[key] for r in runs["old"])
        new = statistics.median(r[key] for r in runs["new"])
        report[key] = {"old": round(old, 4), "new": round(new, 4), "new_over_old": round(new / old, 3) if old else None}
    print(json.dumps({"command": command, "rounds": args.rounds, "figures": report}))


if __name__ == "__main__":
    main()
