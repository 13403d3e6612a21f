"""The embedded demo model: a small GPT-2 with RANDOM weights and a byte-level BPE tokenizer.

Built deterministically on first use and cached under the project's .cache/,
so `make serve` works on a machine with no model hub. Its output is noise:
it exists to exercise the server, not to say anything.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "pagoda-demo"
CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache"
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer: a little English, code, numbers, emoji and
# CJK, so that multi-byte characters exist as merged and as split tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Pagoda serves language models over HTTP.
Once upon a time, in a land far away, there lived a curious engineer who loved fast kernels.
Continuous batching keeps the GPU busy: new requests join while others are still decoding.
A paged KV cache stores keys and values in fixed-size blocks, like pages of virtual memory.
def forward(self, x):\n    return self.proj(x) + x  # residual connection
for i in range(10):\n    print(i, i * i, "hello world")
1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 42 2024 2025 2026
Hello! How are you today? I am fine, thank you. What is the weather like?
User: tell me a story. Assistant: Once there was a tiny model with random weights.
Emoji: 😀 😃 😄 🚀 🌸 🎉 👍 ❤️ 🔥 ✨ 🐍 🦀 — and some accents: café naïve résumé über.
中文：你好，世界！今天天气很好。我们正在测试分词器。日本語：こんにちは世界。한국어: 안녕하세요.
Streaming tokens arrive one by one; each delta must be valid UTF-8 text.
The server answers /v1/completions and /v1/chat/completions in the OpenAI format.
"""


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer as a transformers fast tokenizer, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_demo_model(path: Path, seed: int = 0) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = train_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=1024,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text(
        "Pagoda demo model: random weights, for exercising the server only.\n"
    )


def ensure_demo_model() -> str:
    path = CACHE_DIR / DEMO_MODEL_NAME
    if not (path / "config.json").is_file():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename, so concurrent first uses never see half a model.
        tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR, prefix=".demo-"))
        try:
            build_demo_model(tmp)
            os.replace(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)
