"""Native kernels for the cache-hit path (optional C++/CUDA extension ``kvboost_core._C``).

Import :mod:`kvboost_core.kernels.ops` for the typed entry points; they run the extension when it is built
and the tensors' device is supported, else the pure-torch reference (:mod:`.reference`). Set
``KVBOOST_DISABLE_EXT=1`` to force the reference at runtime (benchmarks, debugging).
"""

from __future__ import annotations

import os
from types import ModuleType

_ext: ModuleType | None = None
_load_error: str | None = None

if os.environ.get("KVBOOST_DISABLE_EXT") != "1":
    try:
        import torch  # noqa: F401  - libtorch must be loaded before the extension's shared object

        from kvboost_core import _C as _ext  # type: ignore[attr-defined, no-redef]
    except Exception as e:  # noqa: BLE001 - not built, or built against another torch: fall back
        _ext, _load_error = None, f"{type(e).__name__}: {e}"
else:
    _load_error = "disabled by KVBOOST_DISABLE_EXT=1"


def has_ext() -> bool:
    return _ext is not None


def has_cuda_ext() -> bool:
    return _ext is not None and bool(getattr(_ext, "with_cuda", False))


def backend() -> str:
    """"cuda-ext+cpu-ext", "cpu-ext" or "torch" (the reference fallback, for good); "pending-jit" while no
    extension is loaded but the first kernel call may still build one (kvboost_core.kernels.ops.ensure_ext):
    "torch" then would be a guess, not the state."""
    if _ext is None:
        from kvboost_core.kernels import ops

        return "torch" if ops.jit_settled() else "pending-jit"
    return "cuda-ext+cpu-ext" if has_cuda_ext() else "cpu-ext"


def load_error() -> str | None:
    """Why the extension is not in use (None when it is)."""
    return _load_error


from kvboost_core.kernels import ops  # noqa: E402  (registers fake implementations when the ext is loaded)

__all__ = ["backend", "has_cuda_ext", "has_ext", "load_error", "ops"]
