"""TTFT benchmark (workloads A and B); a thin wrapper over ``kvboost_rag.app.bench.ttft`` so the CLI and this script
share one implementation. Example:

    python benchmarks/bench_ttft.py --shape qwen2.5-0.5b --json benchmarks/results/ttft.json \
        --plot benchmarks/results/ttft.png
"""

from kvboost_rag.app.bench.ttft import main

if __name__ == "__main__":
    raise SystemExit(main())
