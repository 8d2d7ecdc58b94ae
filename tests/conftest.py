"""Shared fixtures: tiny random-weight models built from configs, a tokenizer trained on the fly, and the
trained stories260K model from ../shared when it is present (tests using it skip cleanly otherwise)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Calibration on first use would change the repair defaults of tests that load a model without a kvboost.json
# (stories260K) part-way through; tests/test_autocalib.py turns it on where it is under test.
os.environ.setdefault("KVBOOST_AUTO_CALIBRATE", "0")

SHARED_STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the valley.",
    "Alice works at the Zentrix Institute as a chemist. She was born in Portvale in 1987.",
    "The capital of Norland is Essberg. Essberg has a large harbour and an old castle.",
    "Question: Where was Alice born? Answer: Portvale.\n\nContext: documents follow.",
    "Bob repairs bicycles in a small shop. His shop opens at nine and closes at five.",
    "Rivers flow to the sea; mountains rise above the clouds! Why do birds sing?",
    "System: You are a helpful assistant. Use the documents to answer the question.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tokenizer():
    return _trained_tokenizer()


ARCH_CONFIGS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "phi3": dict(model_type="phi3"),
    "gemma": dict(model_type="gemma"),
}


def make_tiny_model(arch: str = "llama", *, vocab_size: int = 400, layers: int = 3, seed: int = 0,
                    max_positions: int = 1024, **overrides):
    """A random-weight model of the given family, small enough for CPU tests (GQA: 4 heads, 2 KV heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCH_CONFIGS[arch])
    model_type = spec.pop("model_type")
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, num_hidden_layers=layers, max_position_embeddings=max_positions,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False, **{**sizes, **spec, **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    # Random init with std 0.02 gives near-uniform attention; widen it so positions and context matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def stories():
    """(model, tokenizer) of the trained stories260K Llama, or skip."""
    if not (SHARED_STORIES / "model.safetensors").exists():
        pytest.skip("../shared/models/stories260K is not present")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHARED_STORIES)
    model = AutoModelForCausalLM.from_pretrained(SHARED_STORIES, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), tok


STORY_DOCS = [
    "Once upon a time there was a little girl named Lily. She loved to play in the park with her red ball. "
    "One day she saw a big dog near the swings.",
    "Tom had a big dog called Max. The dog liked to run and jump. One day Max ran away and Tom was very sad. "
    "He looked everywhere for his friend.",
    "The sun was hot. Sam and Mia went to the beach with their mom. They built a sand castle and swam in the "
    "sea until it was time to go home.",
    "A small bird lived in a tall tree. Every morning it sang a happy song for all the animals in the forest. "
    "The rabbit and the fox came to listen.",
    "Ben wanted a cookie. His mom said he had to wait until after dinner. Ben was not happy, but he waited and "
    "helped his mom set the table.",
    "There was a kind old man who had a garden full of flowers. Children came every day to see the flowers and "
    "he gave each of them a pretty one.",
]
STORY_CUES = [" So", " Then", " She", " He", " One day", " The end", " They", " After that"]


_REPORT_LINES: list[str] = []


@pytest.fixture(scope="session")
def report():
    """Tests append measured figures here; they are printed in the terminal summary of every run."""
    return _REPORT_LINES


def pytest_terminal_summary(terminalreporter):
    if _REPORT_LINES:
        terminalreporter.section("kvboost measured figures")
        for line in _REPORT_LINES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def warmed_block(tokenizer):
    """A tiny Llama, an engine with three documents warmed, and a prompt over them as the block construction reads
    it: (model, engine, prompt ids, block runs). The distillation and link-slot tests share it."""
    from helpers import warmed_block_prompt

    model = make_tiny_model("llama")
    eng, ids, runs = warmed_block_prompt(model, tokenizer, [CORPUS[4], CORPUS[2], CORPUS[1]])
    return model, eng, ids, runs


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random model of kvboost_rag.tiny saved as a HF directory: a stand-in for "any other model"."""
    from kvboost_rag.tiny import tiny_model_and_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
