"""One decode step three ways, side by side in one process (issue #35): where the step's time goes and what the
lean step and the native decode attention each take off it.

- ``planned``: the planned forward through HF's modules (``kvboost_core.model.forward.decode_step``), the engine's
  decode before the lean step and still the path for models the lean step does not serve;
- ``lean_sdpa``: the lean step with SDPA (bitwise the planned forward's logits);
- ``lean_native``: the lean step with the native decode attention, what ``generate`` and the server run on the CPU;
- with ``--compile``, ``lean_native_compiled``: that step through ``torch.compile`` (inductor, dynamic shapes),
  with the seconds its first call took (tracing and compiling).

Each path decodes from its own copy of one prefilled cache of ``context`` tokens; medians of ``steps`` steps at
positions context .. context + steps - 1, per thread count and weight precision, after 3 warm-up steps. Also the
attention alone (SDPA against the native kernel over every layer's K/V) and its floor, one read of the same bytes.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_step.py --threads 1,2 --compile --json benchmarks/results/decode_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvboost_rag.app.bench import write_json
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL

PATHS = ("planned", "lean_sdpa", "lean_native")


def _median_ms(fn: Callable[[int], Any], start: int, steps: int) -> float:
    for p in range(3):
        fn(start + p)
    times = []
    for p in range(start, start + steps):
        t0 = time.perf_counter()
        fn(p)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(engine: Any, context: int, steps: int, compile: bool = False) -> dict[str, Any]:
    """``{"step_ms": {path: ms}, "attention_ms": {...}, "lean_sdpa_bitwise": ..., "lean_native_max_diff": ...}``
    for ``engine``'s model (``compile``: also the compiled lean step and ``compile_s``)."""
    import torch

    from kvboost_core.kernels import ops, reference
    from kvboost_core.model.driver import ScatterCache
    from kvboost_core.model.forward import Schedule, decode_step, run_forward
    from kvboost_core.model.lean import lean_decoder

    drv = engine.driver
    if lean_decoder(drv) is None or not ops.decode_kernel(drv.device):
        raise ValueError("the lean step or the native decode attention does not run for this model here")
    cap = context + steps + 4
    ids = torch.randint(100, drv.model.config.vocab_size - 1, (cap,), generator=torch.Generator().manual_seed(0))

    def cache() -> ScatterCache:
        shape = (1, drv.num_kv_heads, cap, drv.head_dim)
        c = ScatterCache([torch.zeros(shape) for _ in range(drv.num_layers)],
                         [torch.zeros(shape) for _ in range(drv.num_layers)])
        pos = torch.arange(context)
        run_forward(drv, ids, c, Schedule(base=pos, candidates=pos[:0]), context)
        return c

    lean, native = lean_decoder(drv), lean_decoder(drv, attend=ops.decode_attention)
    assert lean is not None and native is not None
    paths = (*PATHS, "lean_native_compiled") if compile else PATHS
    caches = {p: cache() for p in paths}
    calls = {"planned": lambda p: decode_step(drv, ids, p, caches["planned"]),
             "lean_sdpa": lambda p: lean.step(ids[p:p + 1], p, caches["lean_sdpa"]),
             "lean_native": lambda p: native.step(ids[p:p + 1], p, caches["lean_native"])}
    extra: dict[str, Any] = {}
    if compile:
        # the undecorated step, compiled, called under inference mode (compiling the decorated one trips over
        # the inference tensors on some models)
        torch._dynamo.reset()  # each model and thread count compiles afresh: its warm-up is its own
        compiled = torch.compile(type(native).step.__wrapped__, dynamic=True)  # type: ignore[attr-defined]

        def run_compiled(p: int) -> Any:
            with torch.inference_mode():
                return compiled(native, ids[p:p + 1], p, caches["lean_native_compiled"])

        calls["lean_native_compiled"] = run_compiled
    first = {name: call(context) for name, call in calls.items() if name != "lean_native_compiled"}
    if compile:  # warm-up: the first call traces and compiles, the second (another length) may compile again
        t0 = time.perf_counter()
        first["lean_native_compiled"] = calls["lean_native_compiled"](context)
        calls["lean_native_compiled"](context + 1)
        extra["compile_s"] = time.perf_counter() - t0
        extra["compiled_max_diff"] = float((first["planned"] - first["lean_native_compiled"]).abs().max())
    for name in PATHS:  # every path one step further, so all time the same positions below
        calls[name](context + 1)
    step_ms = {name: _median_ms(call, context + 2, steps) for name, call in calls.items()}
    c = caches["planned"]
    q = torch.randn(drv.model.config.num_attention_heads, drv.head_dim)
    scale = drv.head_dim ** -0.5

    def attention(fn: Callable[..., Any]) -> Callable[[int], Any]:
        return lambda p: [fn(q, c.keys[i][0], c.values[i][0], context, scale) for i in range(drv.num_layers)]

    floor = lambda p: [(c.keys[i][0, :, :context].sum(), c.values[i][0, :, :context].sum())  # noqa: E731
                       for i in range(drv.num_layers)]
    return {"step_ms": step_ms,
            "attention_ms": {"sdpa": _median_ms(attention(reference.decode_attention), 0, steps),
                             "native": _median_ms(attention(ops.decode_attention), 0, steps),
                             "read_floor": _median_ms(floor, 0, steps)},
            "lean_sdpa_bitwise": bool(torch.equal(first["planned"], first["lean_sdpa"])),
            "lean_native_max_diff": float((first["planned"] - first["lean_native"]).abs().max()), **extra}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--weights", default="fp32,fp16", help="comma-separated weight precisions")
    ap.add_argument("--context", type=int, default=1800, help="tokens in the cache before the first step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--compile", action="store_true", help="also the lean step through torch.compile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from kvboost_core import KVEngine

    engines = {w: KVEngine.from_pretrained(args.model, weights=w) for w in args.weights.split(",")}
    result: dict[str, Any] = {"model": args.model, "context": args.context, "steps": args.steps, "runs": [],
                              "command": "python benchmarks/bench_decode_step.py "
                              + " ".join(sys.argv[1:] if argv is None else argv)}
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)
        for w, engine in engines.items():
            r = {"threads": t, "weights": w, **measure(engine, args.context, args.steps, args.compile)}
            result["runs"].append(r)
            s, a = r["step_ms"], r["attention_ms"]
            print(f"{t} thread(s), {w}: step " + ", ".join(f"{p} {v:.1f} ms" for p, v in s.items())
                  + f"; attention sdpa {a['sdpa']:.1f} ms, native {a['native']:.1f} ms, floor {a['read_floor']:.1f}"
                  f" ms; lean_sdpa bitwise {r['lean_sdpa_bitwise']}, native max diff {r['lean_native_max_diff']:.1e}",
                  flush=True)
    write_json(args.json, result)
    return 0
