"""API keys → namespaces. Each namespace is a tenant with its own KV store namespace and document registry.

The key file is JSON (or YAML when PyYAML is installed) mapping each key to a namespace:
``{"sk-team-a": "team-a", "sk-team-b": "team-b"}``. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
import re
from pathlib import Path

DEFAULT_NAMESPACE = "default"
_NS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def load_key_file(path: str | Path) -> dict[str, str]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--namespace-keys: cannot read {p}: {exc.strerror}") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError("--namespace-keys: a YAML key file needs PyYAML; use JSON instead") from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--namespace-keys: {p} is not valid JSON (line {exc.lineno})") from None
    return validate_keys(data)


def validate_keys(data: object) -> dict[str, str]:
    if not isinstance(data, dict) or not data:
        raise ValueError("--namespace-keys: the file must hold a non-empty mapping {api_key: namespace}")
    out: dict[str, str] = {}
    for n, (key, ns) in enumerate(data.items(), 1):
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"--namespace-keys: entry {n}: keys must be strings of at least 8 characters")
        if not isinstance(ns, str) or not _NS.fullmatch(ns):
            raise ValueError(f"--namespace-keys: entry {n}: namespace must match {_NS.pattern}")
        out[key] = ns
    return out


class KeyRing:
    """Resolves an ``Authorization: Bearer <key>`` header to a namespace. Without keys every request is the
    default namespace (the server then binds to loopback unless told otherwise)."""

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self._keys = [(k.encode(), ns) for k, ns in (keys or {}).items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def namespaces(self) -> list[str]:
        return sorted({ns for _, ns in self._keys}) or [DEFAULT_NAMESPACE]

    def namespace(self, authorization: str | None) -> str | None:
        """The caller's namespace, or None when keys are enabled and this one is missing or unknown."""
        if not self._keys:
            return DEFAULT_NAMESPACE
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        given = authorization[7:].strip().encode()
        found = None
        for key, ns in self._keys:  # every key compared: the time does not say which one matched
            if hmac.compare_digest(key, given):
                found = ns
        return found
