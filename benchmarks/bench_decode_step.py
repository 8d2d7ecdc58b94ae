"""One decode step three ways (planned forward, lean step with SDPA, lean step with the native decode attention);
a thin wrapper over ``kvboost_rag.app.bench.decode_step``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_step.py --threads 1,2 --compile --json benchmarks/results/decode_step.json
"""

from kvboost_rag.app.bench.decode_step import main

if __name__ == "__main__":
    raise SystemExit(main())
