"""Group-wise int4 weights through onnxruntime's ``MatMulNBits`` (issue #35): the GGUF's own blocks, measured.

Issue #35 asks for decode at the weights' own precision from a well-kept library (torch's CPU int4/int8 kernels
are 2-20x slower than fp32 here). onnxruntime's contrib op ``MatMulNBits`` multiplies by 4- or 8-bit block-wise
weights on x86 with AVX2, in two modes: ``accuracy_level=0`` dequantizes and computes in fp32, ``4`` quantizes
the activations to int8 per block of 32 (as llama.cpp's Q4_1 x Q8_1 dot products do) and computes in integers.

Every linear layer of SmolLM2 is built from its GGUF's blocks as they are: Q4_1 (``w = d * q + m``, q in 0..15,
32 per block) as 4-bit codes with scale ``d`` and zero point 0, plus the min term ``m * sum(x over the block)`` in
fp32 in the same graph (``MatMulNBits`` takes only integer zero points fast, and ``-m / d`` is not an integer);
the Q8_0 embedding (the tied head) as 8-bit codes with zero point 128. Rows are matched to the fp32 model's
bitwise (the HF conversion permutes q/k rows), so the weights are exactly the ones the fp32 reference holds.

Measured, side by side in one process, against FBGEMM's fp16 weights (``weights="fp16"``) and fp32 MKL:

- one decode step's linear layers (every layer's q/k/v/o/gate/up/down and the head, one row each, the weights
  streamed from memory as in a decode step), medians, at each ``--threads``;
- a prefill of ``--context`` tokens through the whole model;
- fidelity on ``--prompts`` heldout RAG prompts (k=12): first-token KL against plain HF on the fp32 weights,
  the largest logit difference, greedy answers equal token for token and by first sentence;
- the bytes the int4 form holds against fp32's.

    OMP_NUM_THREADS=1 python benchmarks/bench_int4_ort.py --threads 1,2 --json benchmarks/results/int4_ort.json

Needs ``onnxruntime`` and ``onnx`` (the bench extra); nothing in the package imports them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvboost_rag.app.bench import median_ms, write_json
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, messages

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
MODES = {"ort_int4_fp32": 0, "ort_int4_int8act": 4}  # name -> MatMulNBits accuracy_level


def _blocks(tensor: Any) -> tuple[Any, Any, Any | None]:
    """A GGUF tensor's blocks: Q4_1 -> (q (N, nb, 32) uint8, d, m), Q8_0 -> (q int8, d, None); d/m fp32 (N, nb)."""
    import numpy as np

    kind = tensor.tensor_type.name
    rows = int(tensor.data.shape[0])
    if kind == "Q4_1":
        raw = np.asarray(tensor.data).reshape(rows, -1, 20)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 4:20]
        return np.concatenate([qs & 15, qs >> 4], -1), d, m  # element j < 16: low nibble of byte j; else high
    if kind == "Q8_0":
        raw = np.asarray(tensor.data).reshape(rows, -1, 34)
        return raw[..., 2:34].copy().view(np.int8), raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32), None
    raise ValueError(f"GGUF tensor {tensor.name} is {kind}; this benchmark keeps Q4_1 and Q8_0 blocks only")


def _row_order(weight: Any, deq: Any) -> Any:
    """Index of the GGUF row equal, bit for bit, to each row of the fp32 weight; ValueError if one has none."""
    import numpy as np

    where = {deq[i].tobytes(): i for i in range(deq.shape[0])}
    order = [where.get(weight[i].tobytes()) for i in range(weight.shape[0])]
    if any(i is None for i in order):
        raise ValueError("a weight row differs from every row of the GGUF's dequantized blocks")
    return np.asarray(order)


def _session(q: Any, d: Any, m: Any | None, accuracy: int, threads: int) -> Any:
    """One ``MatMulNBits`` graph (plus the Q4_1 min term): A (M, K) fp32 -> Y (M, N) fp32."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, nb, _ = q.shape
    k = nb * 32
    if m is not None:  # 4-bit: two codes a byte, element 2i in the low nibble
        codes, bits, zero = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), 4, np.zeros(n * ((nb + 1) // 2), np.uint8)
    else:
        codes, bits, zero = (q.astype(np.int16) + 128).astype(np.uint8), 8, np.full(n * nb, 128, np.uint8)
    inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(d.reshape(-1), "S"),
             numpy_helper.from_array(zero, "Z")]
    out = "Y1" if m is not None else "Y"
    nodes = [helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], [out], domain="com.microsoft", K=k, N=n,
                              bits=bits, block_size=32, accuracy_level=accuracy)]
    if m is not None:  # + sum over each block of x, times m: the min term in fp32
        inits += [numpy_helper.from_array(np.ascontiguousarray(m.T), "Mt"),
                  numpy_helper.from_array(np.array([-1, nb, 32], np.int64), "shape"),
                  numpy_helper.from_array(np.array([2], np.int64), "axis")]
        nodes += [helper.make_node("Reshape", ["A", "shape"], ["A3"]),
                  helper.make_node("ReduceSum", ["A3", "axis"], ["Sx"], keepdims=0),
                  helper.make_node("MatMul", ["Sx", "Mt"], ["Y2"]), helper.make_node("Add", ["Y1", "Y2"], ["Y"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _linear_class() -> type:
    import numpy as np
    import torch

    class OrtLinear(torch.nn.Module):
        """fp32 (..., K) -> (..., N) through one session, the tensors bound in place (no copies)."""

        def __init__(self, session: Any, n: int, k: int, nbytes: int) -> None:
            super().__init__()
            self.session, self.n, self.k, self.nbytes = session, n, k, nbytes
            self.binding = session.io_binding()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x.reshape(-1, self.k).float().contiguous()
            y = torch.empty(a.shape[0], self.n)
            self.binding.bind_input("A", "cpu", 0, np.float32, list(a.shape), a.data_ptr())
            self.binding.bind_output("Y", "cpu", 0, np.float32, list(y.shape), y.data_ptr())
            self.session.run_with_iobinding(self.binding)
            return y.reshape(*x.shape[:-1], self.n)

    return OrtLinear


def int4_model(path: str, gguf_file: str, accuracy: int, threads: int) -> tuple[Any, int]:
    """The fp32 model at ``path`` with every linear layer replaced by its GGUF blocks through ``MatMulNBits``;
    returns (model, bytes the replaced layers' codes, scales and mins hold)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = {t.name: t for t in GGUFReader(gguf_file).tensors}
    linear = _linear_class()
    held = 0

    def build(weight: torch.Tensor, tensor: Any) -> Any:
        nonlocal held
        q, d, m = _blocks(tensor)
        deq = q.astype(np.float32) * d[..., None] + (0 if m is None else m[..., None])
        order = _row_order(weight.detach().numpy(), deq.reshape(q.shape[0], -1).astype(np.float32))
        q, d = q[order], d[order]
        m = None if m is None else m[order]
        nbytes = q.size // (2 if m is not None else 1) + d.nbytes + (0 if m is None else m.nbytes)
        held += nbytes
        return linear(_session(q, d, m, accuracy, threads), weight.shape[0], weight.shape[1], nbytes)

    for i, layer in enumerate(model.model.layers):
        for hf, gg in _NAMES.items():
            parent_name, attr = hf.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, build(getattr(parent, attr).weight, tensors[f"blk.{i}.{gg}.weight"]))
    model.lm_head = build(model.lm_head.weight, tensors["token_embd.weight"])
    return model, held



def _linears(model: Any) -> list[tuple[Any, int]]:
    """Every linear layer of ``model`` (fp32, fp16-packed or int4) with its input width."""
    return [(m, int(getattr(m, "in_features", 0) or getattr(m, "k", 0))) for m in model.modules()
            if type(m).__name__ in ("Linear", "PackedLinear", "OrtLinear")]


def step_linears(models: dict[str, Any], rounds: int) -> dict[str, dict[str, float]]:
    """ms for every linear layer of each model once, one row each, as a decode step calls them (the weights
    streamed from memory: together they are larger than the cache): the decoder layers' and the head's apart."""
    import torch

    out = {}
    for name, model in models.items():
        head = model.get_output_embeddings()
        parts = {"layers": [(m, torch.randn(1, k)) for m, k in _linears(model) if m is not head],
                 "head": [(m, torch.randn(1, k)) for m, k in _linears(model) if m is head]}

        def run(calls: list) -> None:
            for m, x in calls:
                m(x)

        with torch.inference_mode():
            out[name] = {part: median_ms(partial(run, calls), rounds) for part, calls in parts.items()}
    return out


def prefill_s(models: dict[str, Any], context: int, rounds: int) -> dict[str, float]:
    """Seconds for one forward of ``context`` tokens through each whole model."""
    import torch

    ids = torch.randint(100, 40000, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return {name: median_ms(partial(model, ids), rounds) / 1e3 for name, model in models.items()}


def fidelity(models: dict[str, Any], tok: Any, prompts: int, k: int, max_new: int) -> dict[str, Any]:
    """Each model against ``models["fp32"]`` on the first ``prompts`` heldout RAG prompts."""
    import torch

    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.bench.precision import agreement, eos_ids
    from kvboost_rag.app.bench.rag import hf_greedy

    ref_model = models["fp32"]
    eos = eos_ids(ref_model, tok)
    sets = rc.retrieval_sets(rc.load_corpus("heldout"), k, 0)[:prompts]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in models if name != "fp32"}
    for q, docs in sets:
        ids = tok.apply_chat_template(messages(q.question, [rc.doc_text(d) for d in docs]),
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.inference_mode():
            ref = hf_greedy(ref_model, tok, ids, max_new, eos)
            for name in rows:
                got = hf_greedy(models[name], tok, ids, max_new, eos)
                rows[name].append({"tokens": len(ids), **agreement(ref, got),
                                   "max_logit_diff": float((got.logits - ref.logits).abs().max())})
    return {name: {"prompts": len(r), "prompt_tokens_median": statistics.median(x["tokens"] for x in r),
                   "first_token_kl_mean": statistics.fmean(x["first_token_kl"] for x in r),
                   "first_token_kl_max": max(x["first_token_kl"] for x in r),
                   "max_logit_diff": max(x["max_logit_diff"] for x in r),
                   "same_answer": statistics.fmean(x["same_answer"] for x in r),
                   "same_first_sentence": statistics.fmean(x["same_first_sentence"] for x in r)}
            for name, r in rows.items()}


def run(model: str, threads: Sequence[int], context: int, prompts: int, k: int, max_new: int,
        rounds: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_core import zoo
    from kvboost_core.model.weights import pack

    spec = zoo.MODELS[model]
    path, gguf_file = zoo.resolve(model), zoo.gguf_path(spec)
    if gguf_file is None:
        raise ValueError(f"{model}: its GGUF is not installed ({spec.install_hint})")
    tok = AutoTokenizer.from_pretrained(path)
    result: dict[str, Any] = {"model": model, "gguf": gguf_file.name, "context": context, "k": k,
                              "max_new_tokens": max_new, "rounds": rounds, "step_linears_ms": {}, "prefill_s": {}}
    for n in threads:
        torch.set_num_threads(n)
        models = {"fp32": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                  "fp16": pack(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), "fp16")}
        held = {}
        for name, accuracy in MODES.items():
            models[name], held[name] = int4_model(path, str(gguf_file), accuracy, n)
        result["step_linears_ms"][str(n)] = step_linears(models, rounds * 5)
        result["prefill_s"][str(n)] = prefill_s(models, context, rounds)
        if n == threads[0]:
            fp32_bytes = sum(m.weight.numel() * 4 for m, _ in _linears(models["fp32"]))
            result["weight_bytes"] = {"fp32": fp32_bytes, "int4 (codes, scales, mins)": held["ort_int4_fp32"]}
            result["fidelity"] = fidelity(models, tok, prompts, k, max_new)
        del models
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--context", type=int, default=1800, help="prefill length (tokens)")
    ap.add_argument("--prompts", type=int, default=24, help="heldout RAG prompts for fidelity")
    ap.add_argument("--k", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        print(f"bench_int4_ort needs onnxruntime and onnx (pip install onnxruntime onnx): {e}", file=sys.stderr)
        return 2
    out = run(args.model, [int(t) for t in args.threads.split(",")], args.context, args.prompts, args.k,
              args.max_new_tokens, args.rounds)
    for n, row in out["step_linears_ms"].items():
        print(f"{n} thread(s), a step's linear layers, decoder layers + head (ms): "
              + ", ".join(f"{m} {v['layers']:.2f} + {v['head']:.2f}" for m, v in row.items()))
        print(f"{n} thread(s), prefill of {args.context} tokens (s): "
              + ", ".join(f"{m} {v:.2f}" for m, v in out["prefill_s"][n].items()))
    for name, f in out["fidelity"].items():
        print(f"{name}: first-token KL {f['first_token_kl_mean']:.2e} (max {f['first_token_kl_max']:.2e}), max logit "
              f"diff {f['max_logit_diff']:.2e}, same answer {f['same_answer']:.0%}, same first sentence "
              f"{f['same_first_sentence']:.0%}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
