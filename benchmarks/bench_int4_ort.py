"""Group-wise int4 weights (the GGUF's Q4_1 blocks) through onnxruntime's MatMulNBits against FBGEMM fp16 and fp32
(issue #35: measured, not adopted); a thin wrapper over ``kvboost_rag.app.bench.int4_ort``. Example:

    OMP_NUM_THREADS=1 python benchmarks/bench_int4_ort.py --threads 1,2 --json benchmarks/results/int4_ort.json
"""

from kvboost_rag.app.bench.int4_ort import main

if __name__ == "__main__":
    raise SystemExit(main())
