"""``kvboost-rag warm``: warm a corpus into the configured KV store tiers and report each tier honestly.

Every configured tier is listed with its own figures (a disk or Redis tier is not the memory tier), and a
tier that cannot be reached (Redis down) fails the command before any work unless ``--allow-degraded``:
"5 entries" printed over a Redis that stored nothing would be a lie.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvboost_rag.app import demo_data as dd

_PROBE_KEY = b"\0" * 16  # looked up once to see whether a tier answers; never stored


def read_documents(src: Path) -> list[str]:
    """Texts of ``*.txt`` files in a directory (sorted by name), or the "text" field of each jsonl line."""
    if src.is_dir():
        files = sorted(src.glob("*.txt"))
        if not files:
            raise SystemExit(f"no .txt files in {src}")
        return [f.read_text(encoding="utf-8") for f in files]
    if src.suffix == ".jsonl" and src.is_file():
        texts = []
        for n, row in enumerate(dd.read_jsonl(src), 1):
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise SystemExit(f"{src}: line {n} has no string 'text' field")
            texts.append(row["text"])
        return texts
    if not src.exists():
        raise SystemExit(f"--docs {src}: no such file or directory")
    raise SystemExit(f"--docs must be a directory of .txt files or a .jsonl file, got {src}")


def _tiers(store: Any) -> list[Any]:
    tiers = getattr(store, "tiers", None)
    return list(tiers) if tiers is not None else [store]


def _label(tier: Any, specs: list[str]) -> str:
    from kvboost_core.store.tiered import tier_name

    name = tier_name(tier)
    same = [s for s in specs if s == name or s.startswith(f"{name}:") or
            (name == "redis" and s.startswith(("redis://", "rediss://")))]
    return f"{name} ({same[0]})" if len(same) == 1 and same[0] != name else name


def _unavailable(stats: dict[str, Any]) -> str | None:
    """Why a tier's own stats say it is not working, or None."""
    if "available" in stats and not stats["available"]:
        return f"unreachable ({stats.get('errors', 0)} errors)"
    if stats.get("errors"):
        return f"{stats['errors']} errors"
    if stats.get("write_errors"):
        return f"{stats['write_errors']} write errors"
    return None


def _describe(stats: dict[str, Any]) -> str:
    if "entries" in stats:
        return f"{stats['entries']} entries, {stats.get('bytes', 0)} bytes"
    parts = [f"{k} {stats[k]}" for k in ("puts", "hits", "errors") if k in stats]
    return ", ".join(parts) or "no figures"


def check_tiers(store: Any, specs: list[str]) -> list[str]:
    """Probe every tier once; the labels of those that do not answer."""
    bad = []
    for tier in _tiers(store):
        try:
            tier.contains(_PROBE_KEY)
        except Exception as exc:  # noqa: BLE001 - a tier raising on a lookup is as unavailable as one timing out
            bad.append(f"{_label(tier, specs)}: {type(exc).__name__}: {exc}")
            continue
        why = _unavailable(tier.stats())
        if why:
            bad.append(f"{_label(tier, specs)}: {why}")
    return bad


def run_warm(args: argparse.Namespace, load_engine: Any) -> int:
    from kvboost_rag import KVBoostRAG

    texts = read_documents(Path(args.docs))
    specs: list[str] = list(args.store)
    loaded = load_engine(args.model, store=specs if len(specs) > 1 else specs[0], chunk_size=args.chunk_size)
    store = loaded.engine.store
    bad = check_tiers(store, specs)
    if bad and not args.allow_degraded:
        print(f"kvboost-rag: error: store tier unavailable: {'; '.join(bad)} (nothing was warmed; pass "
              "--allow-degraded to warm the tiers that work)", file=sys.stderr)
        return 1
    rag = KVBoostRAG(loaded.engine)
    rep = rag.warm_documents(texts, batch_size=args.batch_size, show_progress=False if args.no_progress else None)
    print(f"documents {rep.documents}: warmed {rep.warmed}, already warm {rep.already_warm}; "
          f"tokens {rep.tokens}; bytes added {rep.bytes} ({rep.bytes / 2**20:.2f} MiB); "
          f"{rep.seconds:.2f} s")
    degraded = []
    for tier in _tiers(store):
        stats = tier.stats()
        why = _unavailable(stats)
        label = _label(tier, specs)
        print(f"store {label}: {_describe(stats)}" + (f" [DEGRADED: {why}]" if why else ""))
        if why:
            degraded.append(f"{label}: {why}")
    if degraded and not args.allow_degraded:
        print(f"kvboost-rag: error: store tier failed while warming: {'; '.join(degraded)} (pass "
              "--allow-degraded to accept a partial warm)", file=sys.stderr)
        return 1
    return 0
