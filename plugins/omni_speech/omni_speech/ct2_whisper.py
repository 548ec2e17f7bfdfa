"""A CTranslate2 Whisper model (model.bin, config.json, tokenizer.json) converted into a transformers
`WhisperForConditionalGeneration` directory: config.json, model.safetensors, generation_config.json, the tokenizer
and the feature extractor's config. Run once, at `omni models fetch` (weights.py); needs neither CTranslate2 nor
faster-whisper.

model.bin (format version 6): u32 version, the spec's name, u32 revision, u32 count, then per variable its name,
u8 rank, u32 dims, u8 dtype, u32 byte count and the bytes; then u32 count of aliases (name, target). Strings are a
u16 length (the NUL included) and the bytes. CTranslate2 fuses projections (self-attention's q, k and v into one
`linear_0`; cross-attention's k and v into `linear_1`) and stores a zero bias for k, which Whisper lacks; it keeps
the original precision (fp16 for OpenAI's checkpoints) and the queries unscaled (../shared/FACTS.md).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from omni_kernel.core.errors import ModelError

FORMAT_VERSION = 6
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5 (bf16) has no numpy type
SAMPLING_RATE = 16000
# Whisper's special tokens by their text; their ids differ between vocabularies (English-only, multilingual, v3).
SPECIAL = {"eot": "<|endoftext|>", "sot": "<|startoftranscript|>", "translate": "<|translate|>",
           "transcribe": "<|transcribe|>", "prev": "<|startofprev|>", "no_timestamps": "<|notimestamps|>"}
MULTILINGUAL_VOCAB = 51865  # OpenAI's rule: a vocabulary this large or larger is a multilingual model's
LANGUAGE_TOKEN = re.compile(r"^<\|[a-z]{2,3}\|>$")


def special_tokens(tokenizer: dict) -> tuple[dict[str, int], dict[str, int]]:
    """The special tokens' ids and the language tokens' ids (none for an English-only vocabulary), from the added
    tokens of a tokenizer.json."""
    added = {token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])}
    missing = [text for text in SPECIAL.values() if text not in added]
    if missing:
        raise ModelError(f"tokenizer.json lacks Whisper's special token {missing[0]}")
    tokens = {key: added[text] for key, text in SPECIAL.items()}
    languages = {text: id_ for text, id_ in added.items()
                 if tokens["sot"] < id_ < tokens["translate"] and LANGUAGE_TOKEN.match(text)}
    return tokens, languages


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.offset = 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value[0]

    def string(self) -> str:
        length = self.unpack("<H")
        value = self.data[self.offset:self.offset + length - 1].decode()
        self.offset += length
        return value

    def array(self, dims: list[int], dtype: int, nbytes: int) -> np.ndarray:
        if dtype not in DTYPES:
            raise ModelError(f"model.bin: unsupported dtype code {dtype}")
        raw = self.data[self.offset:self.offset + nbytes]
        self.offset += nbytes
        return np.frombuffer(raw, dtype=DTYPES[dtype]).reshape(dims)


def read_model_bin(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 model.bin by name, aliases resolved."""
    try:
        reader = _Reader(Path(path).read_bytes())
        version = reader.unpack("<I")
        if version != FORMAT_VERSION:
            raise ModelError(f"{Path(path).name}: CTranslate2 format version {version}, not {FORMAT_VERSION}")
        spec = reader.string()
        if spec != "WhisperSpec":
            raise ModelError(f"{Path(path).name}: a {spec}, not a Whisper model")
        reader.unpack("<I")  # the spec's revision
        variables = {}
        for _ in range(reader.unpack("<I")):
            name = reader.string()
            dims = [reader.unpack("<I") for _ in range(reader.unpack("<B"))]
            dtype = reader.unpack("<B")
            variables[name] = reader.array(dims, dtype, reader.unpack("<I"))
        for _ in range(reader.unpack("<I")):
            alias, target = reader.string(), reader.string()
            variables[alias] = variables[target]
    except (OSError, struct.error, ValueError) as exc:
        raise ModelError(f"cannot read {Path(path).name} as a CTranslate2 model: {exc}") from None
    return variables


def _layer_norm(out: dict, prefix: str, source: dict, ct2: str) -> None:
    out[f"{prefix}.weight"] = source[f"{ct2}/gamma"]
    out[f"{prefix}.bias"] = source[f"{ct2}/beta"]


def _linear(out: dict, prefix: str, weight: np.ndarray, bias: np.ndarray | None) -> None:
    out[f"{prefix}.weight"] = weight
    if bias is not None:
        out[f"{prefix}.bias"] = bias


def _fused(out: dict, prefixes: list[str | None], source: dict, ct2: str) -> None:
    """Split a fused projection into `prefixes`, in order; Whisper's key projections have no bias (CTranslate2
    stores zeros)."""
    weights = np.split(source[f"{ct2}/weight"], len(prefixes))
    biases = np.split(source[f"{ct2}/bias"], len(prefixes))
    for prefix, weight, bias in zip(prefixes, weights, biases):
        keeps_bias = not prefix.endswith("k_proj")
        if not keeps_bias and np.any(bias):
            raise ModelError(f"model.bin: {ct2} has a non-zero key bias, which Whisper has not")
        _linear(out, prefix, weight, bias if keeps_bias else None)


def _encoder_layer(out: dict, v: dict, i: int) -> None:
    hf, ct2 = f"model.encoder.layers.{i}", f"encoder/layer_{i}"
    _fused(out, [f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj", f"{hf}.self_attn.v_proj"], v,
           f"{ct2}/self_attention/linear_0")
    _linear(out, f"{hf}.self_attn.out_proj", v[f"{ct2}/self_attention/linear_1/weight"],
            v[f"{ct2}/self_attention/linear_1/bias"])
    _layer_norm(out, f"{hf}.self_attn_layer_norm", v, f"{ct2}/self_attention/layer_norm")
    _feed_forward(out, v, hf, ct2)


def _decoder_layer(out: dict, v: dict, i: int) -> None:
    hf, ct2 = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
    _fused(out, [f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj", f"{hf}.self_attn.v_proj"], v,
           f"{ct2}/self_attention/linear_0")
    _linear(out, f"{hf}.self_attn.out_proj", v[f"{ct2}/self_attention/linear_1/weight"],
            v[f"{ct2}/self_attention/linear_1/bias"])
    _layer_norm(out, f"{hf}.self_attn_layer_norm", v, f"{ct2}/self_attention/layer_norm")
    _linear(out, f"{hf}.encoder_attn.q_proj", v[f"{ct2}/attention/linear_0/weight"],
            v[f"{ct2}/attention/linear_0/bias"])
    _fused(out, [f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"], v, f"{ct2}/attention/linear_1")
    _linear(out, f"{hf}.encoder_attn.out_proj", v[f"{ct2}/attention/linear_2/weight"],
            v[f"{ct2}/attention/linear_2/bias"])
    _layer_norm(out, f"{hf}.encoder_attn_layer_norm", v, f"{ct2}/attention/layer_norm")
    _feed_forward(out, v, hf, ct2)


def _feed_forward(out: dict, v: dict, hf: str, ct2: str) -> None:
    _linear(out, f"{hf}.fc1", v[f"{ct2}/ffn/linear_0/weight"], v[f"{ct2}/ffn/linear_0/bias"])
    _linear(out, f"{hf}.fc2", v[f"{ct2}/ffn/linear_1/weight"], v[f"{ct2}/ffn/linear_1/bias"])
    _layer_norm(out, f"{hf}.final_layer_norm", v, f"{ct2}/ffn/layer_norm")


def _count_layers(variables: dict, side: str) -> int:
    return len(set(re.findall(rf"^{side}/layer_(\d+)/", "\n".join(variables), flags=re.MULTILINE)))


def whisper_tensors(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The CTranslate2 variables under WhisperForConditionalGeneration's names (proj_out is tied, not stored)."""
    out = {}
    for conv in ("conv1", "conv2"):
        _linear(out, f"model.encoder.{conv}", variables[f"encoder/{conv}/weight"], variables[f"encoder/{conv}/bias"])
    out["model.encoder.embed_positions.weight"] = variables["encoder/position_encodings/encodings"]
    _layer_norm(out, "model.encoder.layer_norm", variables, "encoder/layer_norm")
    for i in range(_count_layers(variables, "encoder")):
        _encoder_layer(out, variables, i)
    out["model.decoder.embed_tokens.weight"] = variables["decoder/embeddings/weight"]
    out["model.decoder.embed_positions.weight"] = variables["decoder/position_encodings/encodings"]
    _layer_norm(out, "model.decoder.layer_norm", variables, "decoder/layer_norm")
    for i in range(_count_layers(variables, "decoder")):
        _decoder_layer(out, variables, i)
    return out


def whisper_config(variables: dict[str, np.ndarray], tokens: dict[str, int]) -> dict:
    """WhisperConfig's fields, from the tensors' shapes and the vocabulary's special tokens."""
    vocab, d_model = variables["decoder/embeddings/weight"].shape
    return {
        "vocab_size": int(vocab),
        "num_mel_bins": int(variables["encoder/conv1/weight"].shape[1]),
        "d_model": int(d_model),
        "encoder_layers": _count_layers(variables, "encoder"),
        "decoder_layers": _count_layers(variables, "decoder"),
        "encoder_attention_heads": int(variables["encoder/num_heads"]),
        "decoder_attention_heads": int(variables["decoder/num_heads"]),
        "encoder_ffn_dim": int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_ffn_dim": int(variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "max_source_positions": int(variables["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(variables["decoder/position_encodings/encodings"].shape[0]),
        "bos_token_id": tokens["sot"], "decoder_start_token_id": tokens["sot"],
        "eos_token_id": tokens["eot"], "pad_token_id": tokens["eot"],
        "tie_word_embeddings": True,
        "architectures": ["WhisperForConditionalGeneration"],
    }


def generation_config(ct2_config: dict, tokens: dict[str, int], languages: dict[str, int], max_length: int) -> dict:
    """What transformers' Whisper `generate` reads: the special tokens, the suppressed ones (CTranslate2's config
    keeps OpenAI's lists), the alignment heads (word times)."""
    config = {
        "bos_token_id": tokens["sot"], "decoder_start_token_id": tokens["sot"],
        "eos_token_id": tokens["eot"], "pad_token_id": tokens["eot"],
        "no_timestamps_token_id": tokens["no_timestamps"], "prev_sot_token_id": tokens["prev"],
        "is_multilingual": bool(languages), "max_initial_timestamp_index": 50, "return_timestamps": False,
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [])),
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "max_length": max_length,
    }
    if languages:
        config["lang_to_id"] = languages
        config["task_to_id"] = {"translate": tokens["translate"], "transcribe": tokens["transcribe"]}
    return config


def convert_ct2_whisper(model_dir: Path, out: Path) -> None:
    """Write the WhisperForConditionalGeneration directory for the CTranslate2 model in `model_dir` into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import WhisperConfig, WhisperFeatureExtractor

    model_dir = Path(model_dir)
    try:
        ct2_config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    try:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {model_dir / 'tokenizer.json'}: {exc}") from None
    tokens, languages = special_tokens(tokenizer)
    variables = read_model_bin(model_dir / "model.bin")
    if variables["decoder/embeddings/weight"].shape[0] < MULTILINGUAL_VOCAB:
        languages = {}  # an English-only model: its vocabulary keeps the language tokens, unused
    config = WhisperConfig(**whisper_config(variables, tokens))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        generation_config(ct2_config, tokens, languages, config.max_target_positions), indent=1) + "\n")
    state = {key: torch.from_numpy(np.array(value)) for key, value in whisper_tensors(variables).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "WhisperTokenizer"}) + "\n")
    WhisperFeatureExtractor(feature_size=config.num_mel_bins, sampling_rate=SAMPLING_RATE).save_pretrained(out)


def load_whisper(path: str | Path, dtype=None, device: str = "cpu"):
    """The WhisperForConditionalGeneration in `path`, in eval mode; fp32 unless told (transformers 5 keeps a
    checkpoint's saved fp16 otherwise, and fp16 convolutions fail on CPU)."""
    import torch
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval()
