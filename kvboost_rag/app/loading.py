"""What the CLI, the benches and the server share to get a model running: ``--model`` resolved to a KVEngine
(the embedded demo model by default, a local directory or a hub id otherwise), ``--threads``, and the fidelity
prompts that ``fidelity``, ``calibrate`` and the stories benches compare on.

It sits below :mod:`kvboost_rag.app.cli`, :mod:`kvboost_rag.app.bench` and :mod:`kvboost_rag.app.server`, so the
CLI imports the benches and the server and never the reverse. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.cli_util import UserError

DEMO = "demo"  # --model value meaning "the embedded demo model"


@dataclass
class Loaded:
    engine: Any  # KVEngine
    label: str
    model_dir: Path | None  # where the corpus/held-out files are, for the demo model


def _model_dir(model: str) -> Path | None:
    """The local directory of ``model`` ("demo" is the embedded model), or None for a hub id."""
    path = dd.DEMO_MODEL_DIR if model == DEMO else Path(model)
    return path if path.is_dir() else None


def _hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the HF hub (``HF_ENDPOINT`` or huggingface.co) accepts a TCP connection within ``timeout``."""
    import os
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_model_name(model: str) -> None:
    """Say at once when ``model`` can be nothing loadable: not a local folder, not a short name, not in the
    local HF cache, and the hub off or unreachable (transformers would retry the hub for about a minute)."""
    import os

    from kvboost_core import zoo

    if model == DEMO or zoo.is_zoo_name(model) or Path(model).is_dir():
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - not a valid hub id either: the checks below say what it is not
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline or not _hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise UserError(f"--model {model}: not a local model directory, a known short name "
                        f"({', '.join([*sorted(zoo.MODELS), DEMO])}) or a model in the local HF cache, and {why}")


def load_engine(model: str, *, allow_tiny: bool = False, **engine_kw: Any) -> Loaded:
    """A KVEngine on CPU-or-CUDA for ``model``; with ``allow_tiny`` a missing demo asset falls back to the tiny
    random model (and says so) instead of failing."""
    if not (model.startswith((".", "/", "~")) or Path(model).exists()):  # a path is checked below
        check_model_name(model)
    from kvboost_core import KVEngine

    if model == DEMO and not dd.demo_model_available():
        if not allow_tiny:
            raise SystemExit(f"the embedded demo model is missing ({dd.DEMO_MODEL_DIR}); pass --model PATH or "
                             "build it with scripts/train_demo_model.py")
        from kvboost_rag.tiny import tiny_model_and_tokenizer

        print(f"note: the embedded demo model is missing ({dd.DEMO_MODEL_DIR}); using the tiny random model "
              "from kvboost_rag.tiny instead. Its answers are noise; reuse ratios and timings are real.")
        m, tok = tiny_model_and_tokenizer()
        return Loaded(KVEngine(m, tok, **engine_kw), "kvboost-tiny-random", None)
    target = str(dd.DEMO_MODEL_DIR) if model == DEMO else model
    label = "kvboost demo model" if model == DEMO else model
    if model != DEMO and (model.startswith((".", "/", "~")) or Path(model).exists()) and not Path(model).is_dir():
        raise UserError(f"--model {model}: no such model directory")
    from kvboost_core import EngineConfig

    EngineConfig(**engine_kw)  # a bad engine option is reported as itself, not as a model that fails to load
    try:
        engine = KVEngine.from_pretrained(target, **engine_kw)
    except (OSError, ValueError) as exc:  # HF's loaders: a missing/partial directory, an unknown hub id
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--model {model}: cannot load it as a HuggingFace causal LM ({first})") from exc
    return Loaded(engine, label, _model_dir(model))


def check_model_arg(model: str) -> None:
    """A bench's or trainer's ``--model``, before anything heavy loads: a path must be a directory, and a name
    must be something loadable (:func:`check_model_name`); else one ``UserError`` naming ``--model``."""
    if not (model.startswith((".", "/", "~")) or Path(model).exists()):
        check_model_name(model)
    elif not Path(model).is_dir():
        raise UserError(f"--model {model}: no such model directory")


def load_rag(model: str, device: str = "cpu", **engine_kw: Any) -> Any:
    """``KVBoostRAG.from_model_id(model, device=device, ...)`` for a bench's or trainer's ``--model``, checked
    first (:func:`check_model_arg`, before torch loads); a model HF's loaders cannot read is a ``UserError``
    naming ``--model`` too."""
    check_model_arg(model)
    from kvboost_rag import KVBoostRAG

    try:
        return KVBoostRAG.from_model_id(model, device=device, **engine_kw)
    except OSError as exc:  # HF's loaders: a missing/partial directory, an unknown hub id (adapters: ValueError)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--model {model}: cannot load it as a HuggingFace causal LM ({first})") from exc


def set_threads(threads: int | None, model: str) -> None:
    """Apply ``--threads``. The embedded model is tiny (3M parameters): one thread beats several, whose
    synchronisation costs more than the matmuls, and collapses when the cores are shared (20x measured)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    elif model == DEMO:
        torch.set_num_threads(1)


def has_demo_data(model_dir: Path | None) -> bool:
    return model_dir is not None and (model_dir / dd.CORPUS_FILE).exists() and (model_dir / dd.HELDOUT_FILE).exists()


def fidelity_prompts(loaded: Loaded, n: int, seed: int = 0) -> tuple[list[str], list[Any]]:
    """(documents to warm, prompts): each prompt is 3-4 of the documents in a new order (so their KV is
    re-placed at positions other than where it was computed) followed by a question."""
    from kvboost_core import Segment

    rng = random.Random(seed)
    if has_demo_data(loaded.model_dir):
        assert loaded.model_dir is not None
        corpus = {d["id"]: d["text"] for d in dd.load_corpus(loaded.model_dir)}
        qs = dd.load_heldout(loaded.model_dir)[:n]
        contexts = [([corpus[i] for i in q["context_ids"]], q["question"]) for q in qs]
    else:
        from kvboost_rag.tiny import synthetic_facts

        facts = synthetic_facts(8)
        contexts = [(rng.sample(facts, rng.choice([3, 4])), "Who lives in the city named in the first fact?")
                    for _ in range(n)]
    docs = list(dict.fromkeys(t for ctx, _ in contexts for t in ctx))
    prompts = []
    for ctx, question in contexts:
        segs = [Segment(text="Documents:")]
        for text in ctx:
            segs += [Segment(text="\n\n"), Segment(text=text, cacheable=True)]
        prompts.append(segs + [Segment(text=f"\n\nQuestion: {question}\nAnswer:")])
    return docs, prompts
