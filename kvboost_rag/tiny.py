"""A tiny random-weight Llama and a BPE tokenizer trained on the fly, for examples and smoke tests.

Nothing is downloaded. The model's answers are noise; what it demonstrates is the plumbing: warming, finding
documents in prompts, reuse ratios and timings.
"""

from __future__ import annotations

import functools
from typing import Any

PEOPLE = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun"]
CITIES = ["Portvale", "Essberg", "Lindmoor", "Quarry Bay", "Tessaly", "Norwick", "Caldera", "Ostrel",
          "Brightwater", "Kelmont"]
JOBS = ["chemist", "baker", "pilot", "librarian", "engineer", "nurse", "painter", "carpenter", "geologist",
        "teacher"]
HOBBIES = ["chess", "sailing", "pottery", "astronomy", "cycling", "gardening", "fencing", "origami",
           "birdwatching", "rowing"]


def synthetic_facts(n: int = 20) -> list[str]:
    """``n`` short, distinct documents of made-up facts (deterministic)."""
    out = []
    for i in range(n):
        p, c, j = PEOPLE[i % 10], CITIES[(i * 3 + i // 10) % 10], JOBS[(i * 7 + i // 10) % 10]
        h, year = HOBBIES[(i * 3 + 1) % 10], 1950 + (i * 17) % 60
        out.append(f"Fact {i + 1}: {p} lives in {c} and works as a {j}. {p} was born in {year} and spends "
                   f"weekends on {h}. The {c} library keeps a record of this.")
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


@functools.lru_cache(maxsize=2)
def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (BOS ``<s>`` added in front, EOS ``</s>``, a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = synthetic_facts(20) + ["Use the documents to answer the question. Question: Where does Alice live? "
                                  "Answer:"]
    tok.train_from_iterator(text * 10, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_and_tokenizer(*, layers: int = 2, seed: int = 0, max_positions: int = 2048) -> tuple[Any, Any]:
    """(model, tokenizer): a random Llama (hidden 64, GQA 4/2 heads) sized to the tokenizer's vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # std 0.02 gives near-uniform attention; widen it so context matters
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    model.config._attn_implementation = "sdpa"
    model.float()  # type: ignore[call-arg]
    return model.eval(), tok
