"""A Piper voice (its `.onnx` export and `.onnx.json` config) converted into a transformers `VitsModel` directory:
config.json, model.safetensors, and omni's voice file (VOICE_FILE: the phoneme ids, the espeak-ng voice, the
voice's own noise and length defaults). Run once, at `omni models fetch` (weights.py); `onnx` is needed only here.

Piper trains VITS and exports the inference half to ONNX with weight norm folded in; the weights map one to one
onto VitsModel's (../shared/FACTS.md, "Real speech weights"), with these differences, each handled below:
- the flow's WaveNet convolutions are anonymous initializers (`onnx::Conv_NNNN`): named from the Conv node that
  reads them; VitsModel holds those under weight norm, which vits_decoder.load_voice removes before loading;
- Piper interleaves Flip modules in both flows, which VitsModel does inline: `flow.flows.{0,2,4,6}` are VitsModel's
  `flow.flows.{0,1,2,3}`, the duration predictor's `flows.{3,5,7}` its `flows.{2,3,4}` (`flows.1` is unused at
  inference, so the export dropped it);
- the duration predictor's first flow stores `exp(-log_scale)`, constant-folded by the exporter;
- the "medium" voices' HiFi-GAN uses residual block type 2, which VitsModel lacks: config.json says
  `"resblock": "2"` and vits_decoder supplies the block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from omni_kernel.core.errors import ModelError

VOICE_FILE = "omni_voice.json"  # omni's own file beside config.json: what the phonemizer and the voice list read
EMBEDDING_NODE = "/enc_p/emb/Gather"
DURATION_SCALE = "/dp/flows.0/Exp_output_0"  # exp(-log_scale) of the duration predictor's first flow, folded
# Piper's layer names -> VitsModel's, applied in order to every named tensor (after `_name_anonymous`).
RENAMES = (
    (r"^enc_p\.emb\.weight$", "text_encoder.embed_tokens.weight"),
    (r"^enc_p\.encoder\.attn_layers\.(\d+)\.conv_([qkv])\.", r"text_encoder.encoder.layers.\1.attention.\2_proj."),
    (r"^enc_p\.encoder\.attn_layers\.(\d+)\.conv_o\.", r"text_encoder.encoder.layers.\1.attention.out_proj."),
    (r"^enc_p\.encoder\.attn_layers\.(\d+)\.emb_rel_", r"text_encoder.encoder.layers.\1.attention.emb_rel_"),
    (r"^enc_p\.encoder\.norm_layers_1\.(\d+)\.", r"text_encoder.encoder.layers.\1.layer_norm."),
    (r"^enc_p\.encoder\.norm_layers_2\.(\d+)\.", r"text_encoder.encoder.layers.\1.final_layer_norm."),
    (r"^enc_p\.encoder\.ffn_layers\.(\d+)\.", r"text_encoder.encoder.layers.\1.feed_forward."),
    (r"^enc_p\.proj\.", "text_encoder.project."),
    (r"^dec\.ups\.", "decoder.upsampler."),
    (r"^dec\.", "decoder."),
    (r"^flow\.flows\.(\d+)\.pre\.", lambda m: f"flow.flows.{int(m[1]) // 2}.conv_pre."),
    (r"^flow\.flows\.(\d+)\.post\.", lambda m: f"flow.flows.{int(m[1]) // 2}.conv_post."),
    (r"^flow\.flows\.(\d+)\.enc\.", lambda m: f"flow.flows.{int(m[1]) // 2}.wavenet."),
    (r"^dp\.flows\.(\d+)\.", lambda m: f"duration_predictor.flows.{(int(m[1]) + 1) // 2}."),
    (r"^dp\.pre\.", "duration_predictor.conv_pre."),
    (r"^dp\.proj\.", "duration_predictor.conv_proj."),
    (r"^dp\.convs\.", "duration_predictor.conv_dds."),
    (r"\.pre\.", ".conv_pre."),
    (r"\.proj\.", ".conv_proj."),
    (r"^(duration_predictor\.flows\.\d+)\.convs\.", r"\1.conv_dds."),
    (r"conv_dds\.convs_sep\.", "conv_dds.convs_dilated."),
    (r"conv_dds\.convs_1x1\.", "conv_dds.convs_pointwise."),
    (r"\.gamma$", ".weight"),
    (r"\.beta$", ".bias"),
)
# VitsModel's attention projections are Linear layers; Piper's are 1x1 convolutions.
SQUEEZE = re.compile(r"attention\.(q_proj|k_proj|v_proj|out_proj)\.weight$")


def read_onnx(path: Path) -> tuple[dict[str, np.ndarray], list]:
    """The initializers by name, and the graph's nodes."""
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf's errors have no common base: one line
        raise ModelError(f"cannot read {path.name} as ONNX: {type(exc).__name__}: {exc}") from None
    tensors = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    return tensors, list(model.graph.node)


def _node_weight_name(node_name: str) -> str:
    """`/flow/flows.6/enc/in_layers.0/Conv` -> `flow.flows.6.enc.in_layers.0.weight`."""
    return node_name.strip("/").rsplit("/", 1)[0].replace("/", ".") + ".weight"


def _name_anonymous(tensors: dict[str, np.ndarray], nodes: list) -> dict[str, np.ndarray]:
    """The initializers under Piper's layer names: the convolutions the exporter left anonymous named from the node
    that reads them, the phoneme embedding (exported as `sid`) from its Gather node."""
    named = dict(tensors)
    for node in nodes:
        if node.op_type == "Conv" and len(node.input) > 1 and node.input[1].startswith("onnx::"):
            named[_node_weight_name(node.name)] = named.pop(node.input[1])
        if node.name == EMBEDDING_NODE:
            named["enc_p.emb.weight"] = named.pop(node.input[0])
    return named


def _rename(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def vits_tensors(tensors: dict[str, np.ndarray], nodes: list) -> dict[str, np.ndarray]:
    """Piper's inference weights under VitsModel's names (weight norm folded: plain `.weight` everywhere)."""
    if any(name.startswith(("emb_g.", "dp.cond.", "dec.cond.")) for name in tensors):
        raise ModelError("multi-speaker Piper voices are not supported (this one has speaker embeddings)")
    if DURATION_SCALE not in tensors:
        raise ModelError(f"not a Piper VITS export: no {DURATION_SCALE} (the duration predictor's folded scale)")
    named = _name_anonymous(tensors, nodes)
    out = {_rename(name): value for name, value in named.items()
           if name.startswith(("enc_p.", "dec.", "flow.", "dp.")) and name != "dp.flows.0.m"}
    out["duration_predictor.flows.0.translate"] = named["dp.flows.0.m"]
    out["duration_predictor.flows.0.log_scale"] = -np.log(named[DURATION_SCALE])
    return {name: (value[..., 0] if SQUEEZE.search(name) else value) for name, value in out.items()}


def _attribute(nodes: list, node_name: str, attribute: str) -> list[int]:
    for node in nodes:
        if node.name == node_name:
            for attr in node.attribute:
                if attr.name == attribute:
                    return list(attr.ints)
    raise ModelError(f"not a Piper VITS export: no node {node_name} with {attribute}")


def vits_config(weights: dict[str, np.ndarray], nodes: list, voice: dict) -> dict:
    """VitsConfig's fields for these weights: sizes from the tensors' shapes, strides and dilations from the graph's
    nodes, the noise and length defaults from the voice's config. `resblock` is omni's addition (vits_decoder)."""
    hidden = weights["text_encoder.embed_tokens.weight"].shape[1]
    layers = len({n for n in weights if n.endswith(".attention.q_proj.weight")})
    upsamplers = len({n for n in weights if re.match(r"decoder\.upsampler\.\d+\.weight$", n)})
    kernels = len([n for n in weights if re.match(r"decoder\.resblocks\.\d+\.", n) and n.endswith("s.0.weight")])
    kernels //= upsamplers
    type2 = "decoder.resblocks.0.convs.0.weight" in weights
    conv_name = "convs" if type2 else "convs1"
    dilations = []
    for block in range(kernels):
        count = len([n for n in weights if re.match(rf"decoder\.resblocks\.{block}\.{conv_name}\.\d+\.weight$", n)])
        dilations.append([_attribute(nodes, f"/dec/resblocks.{block}/{conv_name}.{i}/Conv", "dilations")[0]
                          for i in range(count)])
    inference = voice.get("inference", {})
    return {
        "vocab_size": weights["text_encoder.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // weights["text_encoder.encoder.layers.0.attention.emb_rel_k"].shape[2],
        "window_size": (weights["text_encoder.encoder.layers.0.attention.emb_rel_k"].shape[1] - 1) // 2,
        "ffn_dim": weights["text_encoder.encoder.layers.0.feed_forward.conv_1.weight"].shape[0],
        "ffn_kernel_size": weights["text_encoder.encoder.layers.0.feed_forward.conv_1.weight"].shape[2],
        "flow_size": weights["text_encoder.project.weight"].shape[0] // 2,
        "upsample_initial_channel": weights["decoder.conv_pre.weight"].shape[0],
        "upsample_rates": [_attribute(nodes, f"/dec/ups.{i}/ConvTranspose", "strides")[0] for i in range(upsamplers)],
        "upsample_kernel_sizes": [weights[f"decoder.upsampler.{i}.weight"].shape[2] for i in range(upsamplers)],
        "resblock_kernel_sizes": [weights[f"decoder.resblocks.{b}.{conv_name}.0.weight"].shape[2]
                                  for b in range(kernels)],
        "resblock_dilation_sizes": dilations,
        "resblock": "2" if type2 else "1",
        "duration_predictor_filter_channels": weights["duration_predictor.conv_pre.weight"].shape[0],
        "sampling_rate": int(voice["audio"]["sample_rate"]),
        "noise_scale": float(inference.get("noise_scale", 0.667)),
        "noise_scale_duration": float(inference.get("noise_w", 0.8)),
        "speaking_rate": 1.0 / float(inference.get("length_scale", 1.0)),
        "layerdrop": 0.0,
    }


def voice_file(voice: dict, name: str) -> dict:
    """What omni reads besides the model: the voice's name, its phonemes' ids and espeak-ng voice, its defaults."""
    inference = voice.get("inference", {})
    return {
        "name": name,
        "sample_rate": int(voice["audio"]["sample_rate"]),
        "phoneme_type": voice.get("phoneme_type", "espeak"),
        "espeak_voice": voice["espeak"]["voice"],
        "phoneme_id_map": voice["phoneme_id_map"],
        "noise_scale": float(inference.get("noise_scale", 0.667)),
        "noise_w": float(inference.get("noise_w", 0.8)),
        "length_scale": float(inference.get("length_scale", 1.0)),
        "language": voice.get("language", {}).get("code", ""),
    }


def convert_piper(onnx_path: Path, json_path: Path, out: Path, name: str) -> None:
    """Write the VitsModel directory for one Piper voice into `out` (created)."""
    import torch
    from safetensors.torch import save_file
    from transformers import VitsConfig

    try:
        voice = json.loads(Path(json_path).read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the voice config {Path(json_path).name}: {exc}") from None
    if int(voice.get("num_speakers", 1)) != 1:
        raise ModelError(f"{Path(json_path).name}: multi-speaker Piper voices are not supported")
    tensors, nodes = read_onnx(Path(onnx_path))
    weights = vits_tensors(tensors, nodes)
    config = VitsConfig(**vits_config(weights, nodes, voice))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    state = {key: torch.from_numpy(np.array(value, dtype=np.float32)) for key, value in weights.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / VOICE_FILE).write_text(json.dumps(voice_file(voice, name), indent=1, ensure_ascii=False) + "\n")
