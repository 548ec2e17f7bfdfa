"""GGUF file -> a plain transformers directory (bf16 safetensors, tokenizer.json, configs), once, at set-up.

transformers dequantises the GGUF on load (it needs the `gguf` package and accelerate); the result is saved
with save_pretrained so every later run loads it through the ordinary safetensors path (model.py). Nothing
is unpickled. Two repairs make the saved directory behave like the original checkpoint:

- the GGUF loader marks the model as quantised, and save_pretrained refuses such a model: the quantiser and
  `config.quantization_config` are dropped (the weights are already dequantised floats);
- the GGUF tokenizer converter drops SmolLM2's `Digits(individual_digits=True)` pre-tokenizer step, which
  changes how spaces before digits split: it is put back in front of the byte-level step, and the tokenizer is
  saved as a PreTrainedTokenizerFast (a Llama or Qwen2 tokenizer class would swap in its own pre-tokenizer).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from omni_kernel.util.files import UMASK

TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16", digits: bool = True) -> Path:
    """Write the GGUF's model and tokenizer to `out_dir` (which must be empty or absent) with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import quiet_progress

    gguf_path = Path(gguf_path)
    with quiet_progress(), _no_tqdm():  # the dequantising loop draws its own tqdm bar
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=getattr(torch, dtype))
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.model_max_length = model.config.max_position_embeddings
    if digits:
        restore_digit_split(tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        model.eval().save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    _set_tokenizer_class(out_dir / "tokenizer_config.json")
    for file in out_dir.iterdir():  # some writers make 0600 files; a cache entry gets the usual mode
        file.chmod(0o666 & ~UMASK)
    return out_dir


@contextlib.contextmanager
def _no_tqdm():
    saved = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved


def restore_digit_split(tokenizer) -> None:
    """Digits(individual_digits=True) before the byte-level pre-tokenizer, as in SmolLM2's tokenizer.json."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    state = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    steps = state.get("pretokenizers", [state]) if state.get("type") == "Sequence" else [state]
    if any(step.get("type") == "Digits" for step in steps):
        return
    if [step.get("type") for step in steps] != ["ByteLevel"]:
        raise ValueError(f"unexpected GGUF pre-tokenizer {state!r}: expected a single ByteLevel step")
    byte_level = steps[0]
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=byte_level.get("add_prefix_space", False),
                                 trim_offsets=byte_level.get("trim_offsets", True),
                                 use_regex=byte_level.get("use_regex", True)),
    ])


def _set_tokenizer_class(path: Path) -> None:
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["tokenizer_class"] = TOKENIZER_CLASS
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
