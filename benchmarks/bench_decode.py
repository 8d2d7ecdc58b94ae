"""Decode at the weights' own precision against llama.cpp (issue #35); a thin wrapper over
``kvboost_rag.app.bench.decode``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py --threads 1,2 --memory --ops \
        --json benchmarks/results/decode.json --plot benchmarks/results/decode.png
"""

from kvboost_rag.app.bench.decode import main

if __name__ == "__main__":
    raise SystemExit(main())
