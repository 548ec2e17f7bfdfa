"""`omni wan-calibrate`: record a local Wan2.2 checkpoint's MagCache ratios (calibration.py) for `step_cache=mag`.

One text-to-video request runs through the model with every block computed; its sizes and steps should be those
the checkpoint will serve (other step counts get the ratios interpolated, as diffusers does). Imports no torch
until the command runs.
"""

from __future__ import annotations

import logging

import click

from omni_kernel.cli.run import UserFacingError
from omni_kernel.core.errors import OmniError, UserError

log = logging.getLogger("omni")


@click.command("wan-calibrate")
@click.option("--model", "model_path", help="Local Wan2.2 TI2V checkpoint directory (default: the tiny demo model).")
@click.option("--steps", type=int, default=50, show_default=True, help="Denoise steps of the calibration run.")
@click.option("--height", type=int, default=480, show_default=True, help="Video height of the calibration run.")
@click.option("--width", type=int, default=832, show_default=True, help="Video width of the calibration run.")
@click.option("--num-frames", type=int, default=81, show_default=True, help="Frames of the calibration run.")
@click.option("--guidance-scale", type=float, default=5.0, show_default=True, help="Classifier-free guidance.")
@click.option("--prompt", default="a red fox walking through fresh snow in a pine forest, slow camera pan",
              show_default=True, help="The calibration run's prompt.")
@click.option("--seed", type=int, default=0, show_default=True, help="Its noise seed.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the model runs.")
def calibrate_command(model_path, steps, height, width, num_frames, guidance_scale, prompt, seed, device) -> None:
    """Record a checkpoint's MagCache magnitude ratios into the omni cache."""
    try:
        path, ratios = _calibrate(model_path, steps, height, width, num_frames, guidance_scale, prompt, seed, device)
    except UserError as exc:
        raise UserFacingError(" ".join(str(exc).split())) from None
    except OmniError as exc:
        raise click.ClickException(" ".join(str(exc).split())) from None
    click.echo(f"recorded {len(ratios)} magnitude ratios for {model_path or 'the demo model'} in {path}")


def _calibrate(model_path, steps, height, width, num_frames, guidance_scale, prompt, seed, device):
    from . import calibration
    from .demo import ensure_demo_model
    from .device import place
    from .layout import read_layout
    from .loader import load, model_key
    from .params import WanConfig
    from .presets import Settings, validate

    config = WanConfig(model=model_path, device=device)
    layout = read_layout(config.model or ensure_demo_model())
    validate(Settings("calibration", height, width, num_frames, steps, guidance_scale, "", seed), layout)
    if steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    log.info("calibrating MagCache on %s: %d steps of %dx%d, %d frames", layout.path, steps, width, height, num_frames)
    model = load(model_key(layout.path, place(config)))
    ratios = calibration.calibrate(model, prompt, height, width, num_frames, steps, guidance_scale, seed)
    about = {"steps": steps, "height": height, "width": width, "num_frames": num_frames,
             "guidance_scale": guidance_scale, "prompt": prompt, "seed": seed}
    return calibration.record(layout.path, ratios, about), ratios
