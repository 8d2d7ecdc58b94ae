"""Build of the optional native kernels (``kvboost_core._C``); metadata lives in pyproject.toml.

The extension is optional: without a compiler, without torch at build time (pip's default isolated build),
with ``KVBOOST_NO_EXT=1``, or when the compile fails, the package installs without it. The C++ sources are
always shipped (as ``kvboost_core/_csrc``), so the first kernel call builds them against the installed torch
(kvboost_core/kernels/jit.py) and only falls back to the torch reference, with a warning, when that fails.
``KVBOOST_CUDA=1`` adds the CUDA kernels (needs nvcc / CUDA_HOME and a CUDA build of torch).
``KVBOOST_PORTABLE=1`` skips the -mavx2/-mf16c flags added when the build machine supports them.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_ROOT = Path(__file__).resolve().parent


def _jit_module():
    """kvboost_core/kernels/jit.py loaded by path (stdlib only): one definition of the compiler flags for the
    install-time build and the first-use (JIT) build."""
    spec = importlib.util.spec_from_file_location("_kvboost_jit", _ROOT / "kvboost_core" / "kernels" / "jit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_flags() -> list[str]:
    return list(_jit_module().cpu_flags())


def _link_flags() -> list[str]:
    return list(_jit_module().link_flags())


class BuildPyWithSources(build_py):
    """Copy the C++ sources into the package (kvboost_core/_csrc) so an install without the compiled
    extension can still build it on first use."""

    def run(self) -> None:
        super().run()
        dst = Path(self.build_lib) / "kvboost_core" / "_csrc"
        if dst.exists():
            shutil.rmtree(dst)
        for src in [*glob.glob("csrc/*.h"), *glob.glob("csrc/*.cpp"), *glob.glob("csrc/cpu/*")]:
            target = dst / Path(src).relative_to("csrc")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _want_cuda() -> bool:
    if os.environ.get("KVBOOST_CUDA") != "1":
        return False
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False
    return bool(CUDA_HOME or os.environ.get("CUDA_HOME")) and torch.version.cuda is not None


def _extensions() -> tuple[list, dict]:
    if os.environ.get("KVBOOST_NO_EXT") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except Exception as e:  # no torch in the build environment (isolated build): built on first use instead
        print(f"kvboost: native kernels not built now ({e}); they are built on first use against the "
              "installed torch (or install with --no-build-isolation to build them now)", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/bindings.cpp"]
    cxx = _cpu_flags()
    if _want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = ["-O3", "--fmad=false", "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90,code=sm_90"]
        ext = CUDAExtension("kvboost_core._C", sources, define_macros=[("KVBOOST_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx + ["-DKVBOOST_WITH_CUDA"], "nvcc": nvcc},
                            extra_link_args=_link_flags())
    else:
        ext = CppExtension("kvboost_core._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=_link_flags())

    class OptionalBuildExt(BuildExtension):
        """Any compile/link failure leaves a working pure-Python install instead of a failed one."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as e:  # noqa: BLE001 - the extension is optional by design
                print(f"kvboost: native kernels not built ({e}); using the torch fallback", file=sys.stderr)

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001
                print(f"kvboost: native kernels not built ({e}); using the torch fallback", file=sys.stderr)

    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithSources, **cmdclass})
