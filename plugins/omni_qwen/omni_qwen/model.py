"""CausalLM: a local causal-LM directory loaded with transformers: the model, its tokenizer and its limits.

Loading follows a real checkpoint's path exactly (AutoTokenizer / AutoModelForCausalLM, safetensors only,
trust_remote_code off unless asked); the dtype is the config's, or under auto what the machine runs fastest
(precision.py), said in one log line. The model calls belong to the KV backends (backends.py); tokenizing a
prompt to the stage's input processor (inputs.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import omni_hf
import torch
from omni_hf.weights import check_safetensors_index, safetensors_shapes
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from omni_kernel.core.errors import ModelError

from . import precision as _precision

log = logging.getLogger("omni")

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt",
                   "sentencepiece.bpe.model")


def quiet_progress():
    """omni_hf.quiet_hf_load over transformers: no progress bar, library logs at debug, no torch.load."""
    return omni_hf.quiet_hf_load(("transformers",))


# Sanity bounds of config values that size tensors and the KV pool: a value outside is a broken config.
CONFIG_LIMITS = {"max_position_embeddings": 2**24, "vocab_size": 2**24, "hidden_size": 2**17,
                 "num_hidden_layers": 2**12, "num_attention_heads": 2**12, "num_key_value_heads": 2**12,
                 "intermediate_size": 2**20}


def check_config_values(path: Path, config) -> None:
    text = config.get_text_config(decoder=True)
    for key, limit in CONFIG_LIMITS.items():
        value = getattr(text, key, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise ModelError(f"AR model directory {str(path)!r}: config.json {key} = {value!r} is not an integer "
                             f"between 1 and {limit}")


def check_shapes(path: Path, config, trust_remote_code: bool) -> None:
    """Compare the safetensors headers (read without loading a tensor) with the model the config describes,
    built on the meta device: a tensor whose shape differs is refused in one line before loading."""
    if trust_remote_code:
        return
    shapes = safetensors_shapes(path, f"AR model directory {str(path)!r} could not be loaded as a causal LM")
    try:
        with torch.device("meta"), quiet_progress():
            expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    except Exception as exc:  # noqa: BLE001 - a config no model can be built from
        raise ModelError(f"AR model directory {str(path)!r}: config.json describes no buildable model: "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    for key in sorted(set(shapes) & set(expected)):
        if shapes[key] != expected[key]:
            raise ModelError(f"AR model directory {str(path)!r} does not match its config.json: tensor {key} has "
                             f"shape {list(shapes[key])}, the config needs {list(expected[key])}")


def check_model_dir(path: Path, trust_remote_code: bool = False):
    """The directory's config, or a one-line ModelError saying why it is not a loadable causal LM."""
    if not path.exists():
        raise ModelError(f"AR model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelError(f"AR model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"AR model directory {str(path)!r} has no config.json (expected a transformers causal LM)")
    try:
        with quiet_progress():
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - whatever a config's values break, the file is what to fix
        raise ModelError(f"AR model directory {str(path)!r} has an unreadable config.json: "
                         f"{' '.join(str(exc).split())[:300]}") from None
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        raise ModelError(f"AR model directory {str(path)!r} holds a {config.model_type!r} model, "
                         "which is not a causal language model")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"AR model directory {str(path)!r} has no *.safetensors weights "
                         "(omni never loads pickled weights)")
    check_safetensors_index(path, "AR model directory")
    check_config_values(path, config)
    return config


class CausalLM:
    def __init__(self, model, tokenizer, path: Path, device: str, load_ms: float = 0.0, reason: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.device = device
        self.load_ms = load_ms
        self.precision_reason = reason  # why it runs in its dtype (precision.choose)

    @classmethod
    def load(cls, path: str | Path, dtype: str | None = None, device: str | None = None,
             trust_remote_code: bool = False) -> CausalLM:
        path = Path(path).expanduser().resolve()
        omni_hf.torch_dtype(dtype, "ar_dtype")  # an unknown name is refused before anything loads
        config = check_model_dir(path, trust_remote_code)
        device = omni_hf.resolve_device(device, "ar_device")
        chosen = _precision.choose(dtype, device, config)
        start = time.perf_counter()
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelError(f"AR model directory {str(path)!r} has no usable tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)})")
        try:
            with quiet_progress():
                tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is a bad directory
            raise ModelError(f"AR model directory {str(path)!r} has no usable tokenizer: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        check_shapes(path, config, trust_remote_code)
        kwargs: dict[str, Any] = {"use_safetensors": True, "trust_remote_code": trust_remote_code,
                                  "output_loading_info": True}
        if chosen.dtype in _precision.SHORT_NAMES.values():  # else (an unusual checkpoint dtype) the checkpoint's
            kwargs["dtype"] = getattr(torch, chosen.torch_name)
        try:
            with quiet_progress():
                model, info = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except ModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - missing or mismatched weights are a bad directory
            raise ModelError(f"AR model directory {str(path)!r} could not be loaded as a causal LM: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        for what in ("missing", "unexpected", "mismatched"):
            keys = sorted(map(str, info.get(f"{what}_keys") or ()))
            if keys:
                more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
                raise ModelError(f"AR model directory {str(path)!r} does not match its config.json: {what} "
                                 f"tensor(s) {', '.join(keys[:3])}{more}")
        model = model.to(device).eval()
        lm = cls(model, tokenizer, path, device, (time.perf_counter() - start) * 1000, chosen.reason)
        log.info("AR model %s on %s in %s: %s", path.name, device, lm.dtype, chosen.reason)
        return lm

    @property
    def dtype(self) -> str:
        """bf16, fp32 or fp16 (torch's name for any other)."""
        return _precision.short_name(self.model.dtype)

    @property
    def context_window(self) -> int:
        config = self.model.config.get_text_config(decoder=True)
        return int(getattr(config, "max_position_embeddings", None) or self.tokenizer.model_max_length)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).vocab_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
