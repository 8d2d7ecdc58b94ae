"""Build the native kernels on first use when the install did not (the JIT path).

``pip install kvboost-rag`` builds in an isolated environment without torch, so the wheel has no
``kvboost_core._C``. Rather than run slower for ever, the first kernel call compiles the same sources
against the torch that is actually installed (``torch.utils.cpp_extension.load``), once per (sources, torch,
Python, flags), into a cache directory shared by later processes:

- ``KVBOOST_JIT_CACHE`` (default ``$XDG_CACHE_HOME/kvboost/jit`` or ``~/.cache/kvboost/jit``);
- concurrent processes serialize on an ``fcntl`` lock in that directory (released by the OS if a builder
  dies, unlike torch's own lock file, which is removed here when stale);
- ``KVBOOST_NO_JIT=1`` skips it; ``KVBOOST_DISABLE_EXT=1`` disables native kernels altogether.

This module imports only the standard library at import time: setup.py loads it by path for the flags.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import types
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve()
# A wheel carries the sources as kvboost_core/_csrc (setup.py's build_py); a source tree has ./csrc.
SOURCE_DIRS = (_HERE.parents[1] / "_csrc", _HERE.parents[2] / "csrc")
MODULE_NAME = "kvboost_jit_ext"


def cpu_flags() -> list[str]:
    """Compiler flags of the CPU kernels (setup.py uses these too).

    -ffp-contract=off: the kernels must reproduce torch's separate multiply and add bit for bit.
    -fopenmp: at::parallel_for expands to ``#pragma omp parallel`` in our own objects; without it every kernel
    runs on one thread. -g0: debug info triples the build time. -mavx2/-mf16c (and -mfma) only where the CPU has
    them (``KVBOOST_PORTABLE=1`` skips them).
    """
    flags = ["-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    if os.environ.get("KVBOOST_PORTABLE") != "1" and platform.machine() in ("x86_64", "AMD64"):
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            info = ""
        if " avx2" in info and " f16c" in info:
            flags += ["-mavx2", "-mf16c"]
            if " fma" in info:  # for explicit intrinsics only (the decode attention's multiply-adds):
                flags.append("-mfma")  # -ffp-contract=off keeps the compiler from fusing anything else
    return flags


def link_flags() -> list[str]:
    """Linker flags of the extension (setup.py uses these too).

    ``-l:libstdc++.so.6``: the extension must share libtorch's dynamic C++ runtime. A compiler whose own library
    directory holds only the static ``libstdc++.a`` (the lent GPU image's /opt/gcc/bin/g++; a plain ``-lstdc++``
    finds that archive first) links a second runtime into the extension: the first argument error a kernel
    raises then crashes the process (SIGSEGV there) or loses the numbers from its message, because the error is
    formatted and thrown with one runtime and caught by libtorch's. Named by its soname, only the shared library
    matches, and it provides every symbol before the driver's own libraries are searched.
    """
    return ["-fopenmp", "-Wl,--push-state,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--pop-state"]


def source_dir() -> Path | None:
    for d in SOURCE_DIRS:
        if (d / "bindings.cpp").is_file() and any((d / "cpu").glob("*.cpp")):
            return d
    return None


def sources(root: Path) -> list[Path]:
    return sorted((root / "cpu").glob("*.cpp")) + [root / "bindings.cpp"]


def cache_root() -> Path:
    env = os.environ.get("KVBOOST_JIT_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvboost" / "jit"


def build_key(root: Path, torch_version: str) -> str:
    """Digest of everything the binary depends on: sources and headers, torch, Python, flags."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".cpp", ".h", ".hpp") and p.is_file()):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    h.update(f"{torch_version}|{sys.version_info[:2]}|{platform.machine()}|{' '.join(cpu_flags())}".encode())
    return h.hexdigest()[:16]


def why_not() -> str | None:
    """Why a JIT build cannot be attempted here, or None when it can."""
    if os.environ.get("KVBOOST_DISABLE_EXT") == "1":
        return "disabled by KVBOOST_DISABLE_EXT=1"
    if os.environ.get("KVBOOST_NO_JIT") == "1":
        return "JIT build disabled by KVBOOST_NO_JIT=1"
    if source_dir() is None:
        return "the C++ sources are not installed"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (c++/g++) on PATH"
    return None


def _ensure_ninja() -> None:
    """torch's JIT needs ninja on PATH; the pip ``ninja`` package ships one that may not be on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = str(ninja.BIN_DIR) + os.pathsep + os.environ.get("PATH", "")


def build() -> Any:
    """Compile (or reuse the cached build of) the CPU kernels and load them; returns an object standing in
    for the ``_C`` module. Raises on any failure (the caller falls back to torch)."""
    import fcntl

    import torch
    from torch.utils import cpp_extension

    reason = why_not()
    if reason:
        raise RuntimeError(reason)
    root = source_dir()
    assert root is not None
    try:
        registered = hasattr(torch.ops.kvboost, "blend_select")
    except Exception:  # noqa: BLE001 - an unknown namespace: nothing registered
        registered = False
    if registered:  # loading a second library with the same TORCH_LIBRARY would abort the process
        raise RuntimeError("the kvboost ops are already registered by another library")
    out = cache_root() / build_key(root, torch.__version__)
    out.mkdir(parents=True, exist_ok=True)
    _ensure_ninja()
    if not (out / f"{MODULE_NAME}.so").exists():
        logging.getLogger("kvboost").warning(
            "kvboost: the native kernels were not built at install time; building them once for torch %s "
            "(about a minute; cached in %s)", torch.__version__, out)
    with open(out / "kvboost.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then load its result
        try:
            stale = out / "lock"  # torch's FileBaton; a builder killed mid-way leaves it and later loads hang
            if stale.exists():
                stale.unlink()
            path = cpp_extension.load(name=MODULE_NAME, sources=[str(s) for s in sources(root)],
                                      extra_cflags=cpu_flags(), extra_ldflags=link_flags(),
                                      extra_include_paths=[str(root)], build_directory=str(out),
                                      is_python_module=False, verbose=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    # The ops register themselves when the library is loaded (TORCH_LIBRARY static initializers).
    if not hasattr(torch.ops.kvboost, "blend_select"):
        raise RuntimeError(f"built {path} but it registered no kvboost ops")
    return types.SimpleNamespace(__name__=MODULE_NAME, __file__=str(path), with_cuda=False, jit=True)
