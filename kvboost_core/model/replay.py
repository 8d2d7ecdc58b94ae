"""Reusing a check layer's Q/K/V projections for the rows it keeps.

CacheBlend's check layer first computes K/V for every scored row (:meth:`ModelDriver.layer_kv`: the layer runs
up to its ``cache.update``, so its Q, K and V projections all run), then runs the whole layer again for the rows
it keeps. The second pass would project those rows again; :func:`capture` keeps the first pass's projection
outputs and :func:`replaying` makes the second pass read its rows of them instead, with no per-family code:
the layer's own forward runs as usual, only its projection modules answer from the captured outputs.

Only this thread's calls are served from the capture: another thread running the same model at the same time
(a plain HF forward, a decode step) gets the modules' own forward. The override is reference-counted per
module and removed when the last block on any thread leaves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj")  # the attention input projections of the families

_LOCAL = threading.local()  # .table: id(module) -> (1, n', out) rows to return, within replaying() on this thread
_LOCK = threading.Lock()
_INSTALLED: dict[int, int] = {}  # id(module) -> number of replaying() blocks using its override


def projections(attn: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The attention module's input projections by name ({} when it has none of the known ones)."""
    return {name: m for name in PROJECTIONS if isinstance(m := getattr(attn, name, None), torch.nn.Module)}


@contextlib.contextmanager
def capture(attn: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, the yielded dict receives each projection's last output on this thread."""
    out: dict[str, torch.Tensor] = {}
    owner = threading.get_ident()
    hooks = []
    for name, mod in projections(attn).items():
        def hook(_m: Any, _inp: Any, output: torch.Tensor, name: str = name) -> None:
            if threading.get_ident() == owner:
                out[name] = output
        hooks.append(mod.register_forward_hook(hook))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def _override(mod: torch.nn.Module) -> None:
    own = type(mod).forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        table = getattr(_LOCAL, "table", None)
        rows = None if table is None else table.get(id(mod))
        if rows is None:
            return own(mod, x, *args, **kwargs)
        if tuple(x.shape[:-1]) != tuple(rows.shape[:-1]):
            raise RuntimeError(f"a replayed projection was called on input {tuple(x.shape)}; its captured rows "
                               f"are {tuple(rows.shape)}")
        return rows

    mod.forward = forward  # type: ignore[method-assign]


@contextlib.contextmanager
def replaying(attn: torch.nn.Module, captured: dict[str, torch.Tensor], idx: torch.Tensor) -> Iterator[None]:
    """Within the block, on this thread, each captured projection of ``attn`` returns rows ``idx`` (n',) of its
    captured output (1, n, out) instead of computing them."""
    mods = projections(attn)
    table = {id(mods[name]): out[:, idx] for name, out in captured.items() if name in mods}  # (1, n', out)
    with _LOCK:
        for name in captured:
            mod = mods[name]
            if _INSTALLED.get(id(mod), 0) == 0:
                _override(mod)
            _INSTALLED[id(mod)] = _INSTALLED.get(id(mod), 0) + 1
    _LOCAL.table = table
    try:
        yield
    finally:
        _LOCAL.table = None
        with _LOCK:
            for name in captured:
                mod = mods[name]
                _INSTALLED[id(mod)] -= 1
                if _INSTALLED[id(mod)] == 0:
                    del _INSTALLED[id(mod)]
                    del mod.forward
