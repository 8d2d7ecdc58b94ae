"""The CUDA kernels (csrc/cuda/*.cu) compile, on a machine with nvcc and no GPU: `make cuda-compile` at one
architecture (sm_80) and -O1, so a CPU-only change to a shared header or a schema cannot leave the CUDA build
broken until the next GPU lease. Their numerics are tested on a device (tests marked gpu)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("-O1 -std=c++20 --fmad=false -DKVBOOST_WITH_CUDA -DTORCH_API_INCLUDE_EXTENSION_H "
         "-gencode=arch=compute_80,code=sm_80 --expt-relaxed-constexpr -Xcompiler -fPIC")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_every_cuda_kernel_compiles(tmp_path):
    sources = sorted(p.name for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    assert "decode_attn.cu" in sources
    env = {**os.environ, "MAKEFLAGS": ""}
    done = subprocess.run(["make", "-s", "cuda-compile", f"KVB_PY={sys.executable}", f"KVB_CUDA_OUT={tmp_path}",
                           f"KVB_NVCC_FLAGS={FLAGS}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    built = sorted(p.stem for p in tmp_path.glob("*.o"))
    assert built == sorted(Path(s).stem for s in sources)
