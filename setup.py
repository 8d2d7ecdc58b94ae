"""Build of the optional native kernels (``kvboost_core._C``); metadata lives in pyproject.toml.

The extension is optional: without a compiler, without torch at build time, with ``KVBOOST_NO_EXT=1``, or
when the compile fails, the package installs as pure Python and kvboost_core.kernels falls back to torch.
``KVBOOST_CUDA=1`` adds the CUDA kernels (needs nvcc / CUDA_HOME and a CUDA build of torch).
``KVBOOST_PORTABLE=1`` skips the -mavx2/-mf16c flags added when the build machine supports them.
"""

from __future__ import annotations

import glob
import os
import platform
import sys

from setuptools import setup


def _cpu_flags() -> list[str]:
    # -ffp-contract=off: the kernels must reproduce torch's separate multiply and add bit for bit.
    # -fopenmp: at::parallel_for is header code that expands to `#pragma omp parallel` in our own objects;
    # without it every kernel runs on one thread. -g0: debug info triples the build time.
    flags = ["-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    if os.environ.get("KVBOOST_PORTABLE") != "1" and platform.machine() in ("x86_64", "AMD64"):
        try:
            with open("/proc/cpuinfo") as f:
                info = f.read()
            if " avx2" in info and " f16c" in info:
                flags += ["-mavx2", "-mf16c"]
        except OSError:
            pass
    return flags


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
    except Exception as e:  # no torch in the build environment (isolated build): pure Python
        print(f"kvboost: building without native kernels ({e})", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/bindings.cpp"]
    cxx = _cpu_flags()
    if _want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = ["-O3", "--fmad=false", "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90,code=sm_90"]
        ext = CUDAExtension("kvboost_core._C", sources, define_macros=[("KVBOOST_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx + ["-DKVBOOST_WITH_CUDA"], "nvcc": nvcc},
                            extra_link_args=["-fopenmp"])
    else:
        ext = CppExtension("kvboost_core._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])

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
setup(ext_modules=ext_modules, cmdclass=cmdclass)
