"""`pip install .` with pip's default build isolation still ends with working native kernels.

The isolated build has no torch, so it cannot compile the extension; the wheel ships the C++ sources and the
first kernel call builds them against the installed torch (kvboost_core/kernels/jit.py). Slow (a package
build plus a C++ compile, about 2 minutes on 2 cores): torch and the other dependencies are not installed
again but borrowed from the running interpreter's site-packages through a .pth file (which does not process
that directory's own .pth files, so an editable install of this repo there stays invisible).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import json, kvboost_core, torch
from kvboost_core import kernels
from kvboost_core.kernels import ops, reference
ok = ops.ensure_ext()
f, c = torch.randn(2, 40, 8), torch.randn(2, 40, 8)
same = ops.blend_select(f, c, 0.25).tolist() == reference.blend_select(f, c, 10, None).tolist()
print(json.dumps({"file": kvboost_core.__file__, "backend": kernels.backend(), "ok": ok, "same": same,
                  "jit": bool(getattr(kernels._ext, "jit", False))}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_isolated_pip_install_gets_a_kernel_backend(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    target = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    borrowed = [p for p in site.getsitepackages() if Path(p, "torch").is_dir()]
    if not borrowed:
        pytest.skip("torch is not in this interpreter's site-packages")
    Path(target, "_borrowed_deps.pth").write_text("\n".join(borrowed) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVBOOST_DISABLE_EXT", "KVBOOST_NO_JIT")}
    env["KVBOOST_JIT_CACHE"] = str(tmp_path / "jit-cache")
    env.setdefault("MAX_JOBS", "2")
    # default isolation: no --no-build-isolation; --no-deps: the dependencies are the borrowed ones
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)], env=env,
                             capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    meta = next(Path(target).glob("kvboost_rag-*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in meta.read_text()  # SPDX string, not the deprecated table
    run = subprocess.run([str(py), "-c", CHECK], env=env, capture_output=True, text=True, timeout=420,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    info = json.loads(run.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(venv)), info  # the installed copy, not this source tree
    assert info["ok"] and info["backend"] != "torch", (info, run.stderr[-2000:])
    assert info["same"]
    print(f"isolated install: backend {info['backend']} ({'built on first use' if info['jit'] else 'built at install'})")
