"""The server's decode batch over a shared page pool against dense rows (issue #36); a thin wrapper over
``kvboost_rag.app.bench.kv_pool``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_kv_pool.py --threads 1 --json benchmarks/results/kv_pool.json
"""

from kvboost_rag.app.bench.kv_pool import main

if __name__ == "__main__":
    raise SystemExit(main())
