"""GPU check (not in CI): the Wan stage's GPU paths, which the CPU test suite cannot run, measured on a CUDA machine.

On the demo-size checkpoint built locally (random weights), one JSON line with:

- `placements`: per offload setting (`model_cpu_offload`, the default with a GPU, and `off`), the trace's device,
  dtype, VAE dtype and offload, whether the MP4 export ran on the export thread, the request's time, and its
  frames against the CPU's fp32 run of the same request (`max_abs_diff_vs_cpu`, `mean_abs_diff_vs_cpu`; frames in
  [0, 1]);
- `offload_on_vs_off`: the largest frame difference between the two GPU runs;
- `text_kv_vs_stock`: one transformer forward in the stage's dtype with the text keys and values projected once
  (used when offload is off) against diffusers' own cross-attention, for texts padded as the pipeline pads them;
- `batched_vs_solo`: three requests (different prompts, images, seeds, guidance), the third joining when the first
  is 3 steps in, against each one's solo run, with offload off (`max_abs_diff` per request);
- `t2v`, `mixed_batch`: text-to-video and a batch mixing it with image-to-video: "not built yet" (no wan_t2v).

    HF_HUB_OFFLINE=1 python benchmarks/gpu_check.py [--device cpu]    # cpu: a dry run of the same code, 4 steps

scripts/device_check.sh runs it on the device machine. The figures are reported, not judged: the thresholds of a
GPU test come from them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
IMAGE = str(ROOT / "examples" / "assets" / "image.png")
REQUEST = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 8, "guidance_scale": 5.0}
JOBS = {"a": ("a red fox in the snow", 1, 5.0), "b": ("a boat on a calm lake", 2, 3.0),
        "c": ("a city street at night", 3, 7.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.device == "cpu":  # the dry run: the same requests with fewer steps (c still joins a batch mid-way)
        REQUEST["num_inference_steps"] = 4
    import torch

    from omni_kernel import Omni
    from omni_wan.demo import build_tiny_checkpoint

    report = {"check": "gpu", "device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    with tempfile.TemporaryDirectory(prefix="omni-gpu-check-") as tmp:
        work = Path(tmp)
        model = str(build_tiny_checkpoint(work / "model"))
        images = _images(work)
        cpu = Omni("wan_i2v", model=model, device="cpu")
        reference = _frames(cpu, "a", images, work)
        report["placements"], frames = {}, {}
        for offload in ("model_cpu_offload", "off"):
            omni = Omni("wan_i2v", model=model, device=args.device, disable_cpu_offload=offload == "off")
            _frames(omni, "a", images, work)  # load and warm up
            start = time.perf_counter()
            result = _run(omni, "a", images, work)
            elapsed = time.perf_counter() - start
            frames[offload] = result.output.data["frames"]
            diff = abs(frames[offload] - reference)
            report["placements"][offload] = {
                **{k.removeprefix("diffusion."): result.trace.get(k) for k in
                   ("diffusion.device", "diffusion.dtype", "diffusion.vae_dtype", "diffusion.offload",
                    "diffusion.denoise_ms", "diffusion.vae_decode_ms")},
                "export_in_background": omni.graph.stages["wan"].engine.runner.export_in_background,
                "request_s": round(elapsed, 3), "max_abs_diff_vs_cpu": float(diff.max()),
                "mean_abs_diff_vs_cpu": float(diff.mean())}
            if offload == "off":
                report["batched_vs_solo"] = _batched_vs_solo(omni, images, work)
            print(json.dumps({offload: report["placements"][offload]}), flush=True)
        report["offload_on_vs_off"] = float(abs(frames["model_cpu_offload"] - frames["off"]).max())
        report["text_kv_vs_stock"] = _text_kv_vs_stock(model, args.device)
    if "wan_t2v" not in cpu.host.registry.pipelines:
        report["t2v"] = report["mixed_batch"] = "not built yet: no wan_t2v pipeline is registered"
    print(json.dumps(report))


def _run(omni, rid: str, images: dict, work: Path):
    prompt, seed, guidance = JOBS[rid]
    return omni.generate(prompt, image=images[rid], **{**REQUEST, "guidance_scale": guidance}, seed=seed,
                         output=str(work / f"{rid}_{time.time_ns()}.mp4"), return_frames=True)


def _frames(omni, rid: str, images: dict, work: Path):
    return _run(omni, rid, images, work).output.data["frames"]


def _batched_vs_solo(omni, images: dict, work: Path) -> dict:
    """a and b together from the start, c joining when a is 3 steps in; each against its solo run."""
    from omni_kernel import RequestFailed, RequestFinished, StageProgress

    def request(rid):
        prompt, seed, guidance = JOBS[rid]
        return omni.request(prompt, image=images[rid], request_id=f"batch-{rid}-{time.time_ns()}",
                            **{**REQUEST, "guidance_scale": guidance}, seed=seed,
                            output=str(work / f"batch_{rid}.mp4"), return_frames=True)

    requests = {rid: request(rid) for rid in JOBS}
    names = {r.request_id: rid for rid, r in requests.items()}
    omni.submit(requests["a"])
    omni.submit(requests["b"])
    joined, batched, sizes = False, {}, []
    while len(batched) < len(JOBS):
        for event in omni.step():
            if isinstance(event, StageProgress) and names.get(event.request_id) == "a" and event.step >= 3 \
                    and not joined:
                omni.submit(requests["c"])
                joined = True
            elif isinstance(event, RequestFailed):
                raise RuntimeError(f"{event.request_id} failed: {event.error}")
            elif isinstance(event, RequestFinished):
                batched[names[event.request_id]] = event.result.output.data["frames"]
                sizes.append(event.result.trace.get("diffusion.batch_size_max"))
    return {"batch_size_max": max(sizes),
            "max_abs_diff": {rid: float(abs(batched[rid] - _frames(omni, rid, images, work)).max()) for rid in JOBS}}


def _text_kv_vs_stock(model: str, device: str) -> dict:
    import torch
    from diffusers import WanTransformer3DModel

    from omni_wan.crossattn import CrossKV

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    transformer = WanTransformer3DModel.from_pretrained(model, subfolder="transformer", torch_dtype=dtype)
    transformer = transformer.to(device).eval()
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(3, transformer.config.in_channels, 3, 4, 6, generator=generator).to(device, dtype)
    timesteps = torch.tensor([999.0, 500.0, 20.0]).repeat_interleave(3 * 2 * 3).view(3, -1).to(device)
    texts = torch.randn(3, 512, transformer.config.text_dim, generator=generator)
    texts[0, 20:] = 0
    texts[1, 7:] = 0
    texts = texts.to(device, dtype)

    def forward(text):
        with torch.no_grad():
            return transformer(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text,
                               return_dict=False)[0].float()

    expected = forward(texts)
    cross = CrossKV(transformer)
    rows = cross.project(texts)
    with cross.use(rows):
        got = forward(cross.placeholder(3, dtype, device))
    return {"dtype": str(dtype).removeprefix("torch."), "max_abs_diff": float((got - expected).abs().max()),
            "output_abs_max": float(expected.abs().max())}


def _images(work: Path) -> dict:
    from PIL import Image

    paths = {}
    for rid, colour in zip(JOBS, ("red", "blue", "green")):
        paths[rid] = str(work / f"{colour}.png")
        Image.new("RGB", (120, 80), colour).save(paths[rid])
    return paths


if __name__ == "__main__":
    main()
