"""The models the synthetic TTFT benchmark (``kvboost-rag bench``) runs on: a random-weight model of a named
shape (real layer sizes, no download) or a local HF model / short name. torch loads on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0),
    # real-scale timings on a GPU (bf16): 7.6B parameters, 15 GB of weights
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, tie_word_embeddings=False, rope_theta=1000000.0),
    "tiny": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch's name (torch is lazy)


def build_model(shape: str, layers: int | None, seed: int = 0, device: str = "cpu",
                dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A random-weight model of a named shape (fp32 unless ``dtype``) and a small tokenizer trained on the fly.
    The weights are made on ``device`` (a 7B shape initialised on the CPU first would take minutes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvboost_rag.tiny import tiny_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)} or pass --model PATH")
    spec = dict(SHAPES[shape])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32, attn_implementation="sdpa")
    return model.eval(), tiny_tokenizer()


def load_model(path: str, device: str = "cpu", dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A local HF model (fp32 unless ``dtype``) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation="sdpa")
    return model.to(device).eval(), tok


def model_path(name: str) -> str:
    """A local model directory, or a kvboost zoo short name (``smollm2-135m-instruct``) resolved offline."""
    from kvboost_core import zoo

    return zoo.resolve(name) if zoo.is_zoo_name(name) else name
