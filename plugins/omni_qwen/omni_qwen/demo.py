"""The tiny random-weight Qwen2 demo checkpoint, built locally on first use (no hub, no download).

It is a real Qwen2ForCausalLM with a real byte-level BPE tokenizer trained here, saved with save_pretrained,
so it loads through exactly the code path of a real checkpoint. Its text is noise: it shows the runtime, not
a model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from omni_kernel.core.errors import ModelError
from omni_kernel.util.files import cache_dir

from .bridge_prompt import bridge_prompt

log = logging.getLogger("omni")

DEMO_NAME = "qwen2-tiny"
DEMO_CONTEXT_WINDOW = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenizer pattern (the same one Qwen2Tokenizer builds), so a rewrite of the demo tokenizer into
# the vocab.json + merges.txt layout tokenizes identically.
QWEN2_PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# The tokenizer is trained on this text, so it stays as written: the bridge's worked answers in the JSON that
# omni_bridge's pipelines ask for (their answer prefix), as in the guidance line below.
CORPUS_ANSWER_PREFIX = '{"guidance": "'
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A small model streams text one token at a time.",
    "omni runs a pipeline of stages: a language model writes, a video model renders, a connector joins them.",
    "The school stands at the end of a quiet street, with a red gate, a playground and tall old trees.",
    "Students walk into their classrooms in the morning; teachers open the windows and the lesson begins.",
    "In the library, children read books about science, history, music and the stars above the city.",
    "A camera slowly pans across the valley at sunrise; soft golden light, mist over the river, cinematic.",
    "Write a short story about a cat who learns to paint. Describe the weather in Paris in spring.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2025, and symbols: ( ) [ ] { } < > = + - * / % & | ! ? : ; , .",
    '{"guidance": "slow dolly shot, warm evening light, gentle wind in the trees", "negative_prompt": "blur"}',
    "学校坐落在城市的东边，校园里有一座图书馆、一个操场和许多高大的树。",
    "每天早上，学生们走进教室，老师开始上课。下课以后，孩子们在操场上跑步、踢球、聊天。",
    "请写一段文字，描述一所学校的春天：花开了，鸟在唱歌，阳光照在教学楼上。",
    "生成一篇关于城市、河流和山的文章。我们喜欢读书，也喜欢音乐和电影。",
    "Café, naïve, façade, résumé, über, Straße, español, niño, Ångström, ça va ?",
    "def generate(prompt):\n    return model(prompt)\n\nfor i in range(10):\n    print(i)\n",
    "你好，世界！Hello, world! こんにちは。안녕하세요。Привет, мир!",
) + (bridge_prompt("", CORPUS_ANSWER_PREFIX),)  # the bridge's instruction and worked examples: they encode compactly


def demo_dir() -> Path:
    return cache_dir() / "demo" / DEMO_NAME


def ensure_demo_checkpoint() -> Path:
    """The demo checkpoint's directory, built on first use; concurrent builders never see a half-written one."""
    target = demo_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.", dir=target.parent))
    try:
        build_checkpoint(tmp, context_window=DEMO_CONTEXT_WINDOW, initializer_range=0.5)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if not (target / "config.json").is_file():  # not a lost race with another builder
                raise ModelError(f"cannot build the demo AR model in {str(target)!r}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_tokenizer(texts=CORPUS, vocab_size: int = 1000):
    """A Qwen2-style byte-level BPE trained on `texts`, wrapped as a transformers Qwen2Tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    backend = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(list(texts), trainer=trainer)
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = Qwen2Tokenizer(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_checkpoint(path: Path, *, context_window: int = DEMO_CONTEXT_WINDOW, initializer_range: float = 0.02,
                     seed: int = 0, vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 2,
                     tokenizer=None, dtype: str = "float32") -> Path:
    """Save a random-weight Qwen2ForCausalLM and its tokenizer to `path` with save_pretrained."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from .model import quiet_progress

    tokenizer = tokenizer or train_tokenizer()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context_window, initializer_range=initializer_range,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=eos[0], pad_token_id=eos[1])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1], bos_token_id=None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
