"""Fidelity of a weight precision against fp32 (issue #35); a thin wrapper over
``kvboost_rag.app.bench.precision``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_precision.py --split heldout --weights fp16 \
        --json benchmarks/results/precision_fp16.json
"""

from kvboost_rag.app.bench.precision import main

if __name__ == "__main__":
    raise SystemExit(main())
