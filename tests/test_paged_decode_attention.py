"""Decode attention over a page pool (issue #36): ``kvboost_core.kernels.ops.paged_decode_attention`` reads each
key and value from the page a request's table names, with no dense copy. Checked against the dense kernel on the
gathered rows (bitwise: the same summation order), a float64 reference over random page tables, GQA ratios and
head dims, the pool's own torch path (``serving.pages.paged_attention``), its argument checks and its fallback."""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import _float64

from kvboost_core import kernels
from kvboost_core.kernels import ops, reference
from kvboost_core.serving.pages import PagePool, PageTable, paged_attention

needs_ext = pytest.mark.skipif(not kernels.has_ext(), reason=f"kvboost_core._C not built ({kernels.load_error()})")

# (query heads, KV heads, head_dim, page tokens, pages in the pool, length): GQA 3/4/1, the AVX2 widths and the
# scalar path (12, 40), pages of 1, 7, 16 and 64 tokens, lengths ending mid-page and on a page boundary
SHAPES = [(9, 3, 64, 16, 140, 1800), (4, 4, 16, 1, 60, 37), (8, 2, 12, 7, 50, 257), (32, 8, 128, 64, 12, 640),
          (6, 2, 32, 16, 8, 9), (4, 1, 40, 16, 6, 64)]


def _case(h, kv, d, p_tok, n_pages, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(h, d, generator=g)
    k_pool = torch.randn(n_pages, kv, p_tok, d, generator=g) * 2
    v_pool = torch.randn(n_pages, kv, p_tok, d, generator=g)
    need = -(-length // p_tok)
    pages = torch.randperm(n_pages, generator=g)[:need]  # a table's pages: any order, any ids
    return q, k_pool, v_pool, pages


def _dense(pool, pages):
    return pool.index_select(0, pages).transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])


@needs_ext
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_paged_is_the_dense_kernel_on_the_gathered_rows_bitwise(shape):
    h, kv, d, p_tok, n_pages, n = shape
    q, k_pool, v_pool, pages = _case(h, kv, d, p_tok, n_pages, n)
    scale = d ** -0.5
    got = ops.paged_decode_attention(q, k_pool, v_pool, pages, n, scale)
    dense = ops.decode_attention(q, _dense(k_pool, pages).contiguous(), _dense(v_pool, pages).contiguous(), n, scale)
    assert torch.equal(got, dense)
    exact = _float64(q, _dense(k_pool, pages), _dense(v_pool, pages), n, scale)
    sdpa = reference.paged_decode_attention(q, k_pool, v_pool, pages, n, scale)
    err, sdpa_err = float((got.double() - exact).abs().max()), float((sdpa.double() - exact).abs().max())
    assert err <= max(2e-6, 2 * sdpa_err), (err, sdpa_err)


@needs_ext
def test_a_perturbed_page_or_table_changes_the_result():
    """The kernel reads the pages the table lists, in its order: swapping two entries, or writing into a listed
    page, changes the output; writing into a page not listed does not."""
    q, k_pool, v_pool, pages = _case(4, 2, 16, 8, 20, 60)
    base = ops.paged_decode_attention(q, k_pool, v_pool, pages, 60, 0.25)
    swapped = pages.clone()
    swapped[[0, 3]] = swapped[[3, 0]]
    assert not torch.equal(ops.paged_decode_attention(q, k_pool, v_pool, swapped, 60, 0.25), base)
    other = next(p for p in range(20) if p not in set(pages.tolist()))
    v2 = v_pool.clone()
    v2[other] += 1.0
    assert torch.equal(ops.paged_decode_attention(q, k_pool, v2, pages, 60, 0.25), base)
    v2[int(pages[2])] += 1.0
    assert not torch.equal(ops.paged_decode_attention(q, k_pool, v2, pages, 60, 0.25), base)


@needs_ext
def test_the_pool_s_torch_path_agrees():
    """serving.pages.paged_attention (online softmax in torch, page by page) and the kernel read one table alike."""
    pool = PagePool(2, 2, 32, 16, byte_budget=2 * 2 * 2 * 16 * 32 * 4 * 10)
    table = PageTable(pool)
    g = torch.Generator().manual_seed(1)
    table.slots_for(70)
    for layer in range(2):
        pool.write(table, layer, torch.randn(2, 70, 32, generator=g), torch.randn(2, 70, 32, generator=g), 0)
    q = torch.randn(6, 32, generator=g)
    pages = torch.tensor(table.pages)
    for layer in range(2):
        got = ops.paged_decode_attention(q, pool.keys(layer), pool.values(layer), pages, table.tokens, 32 ** -0.5)
        ref = paged_attention(q.view(6, 1, 32), pool, table, layer, scale=32 ** -0.5).view(6, 32)
        assert torch.allclose(got, ref, atol=2e-6), float((got - ref).abs().max())


@needs_ext
def test_bad_arguments_name_the_problem():
    q, k_pool, v_pool, pages = _case(4, 2, 16, 8, 10, 30)
    with pytest.raises(ValueError, match="length"):
        ops.paged_decode_attention(q, k_pool, v_pool, pages, 33, 0.25)  # 4 pages of 8 hold 32
    with pytest.raises(ValueError, match="outside the pool"):
        ops.paged_decode_attention(q, k_pool, v_pool, torch.tensor([0, 1, 10, 2]), 30, 0.25)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ops.paged_decode_attention(q[:3], k_pool, v_pool, pages, 30, 0.25)
    with pytest.raises(ValueError, match="one shape"):
        ops.paged_decode_attention(q, k_pool, v_pool[:, :, :4], pages, 30, 0.25)
    with pytest.raises(ValueError, match="length"):
        reference.paged_decode_attention(q, k_pool, v_pool, pages, 0, 0.25)


def test_other_dtypes_run_the_reference():
    q, k_pool, v_pool, pages = _case(4, 2, 16, 8, 10, 30)
    got = ops.paged_decode_attention(q.double(), k_pool.double(), v_pool.double(), pages, 30, 0.25)
    exact = _float64(q, _dense(k_pool, pages), _dense(v_pool, pages), 30, 0.25)
    assert got.dtype == torch.float64 and torch.allclose(got, exact, atol=1e-12)


@needs_ext
def test_the_benchmark_measures_every_arm_on_the_same_rows(tmp_path):
    """benchmarks/bench_paged_attention.py on a small geometry: every arm timed, and every paged arm bitwise the
    dense kernel on the same rows (the check that makes its timings comparable)."""
    import json

    from kvboost_rag.app.bench.paged_attention import main

    out = tmp_path / "paged.json"
    assert main(["--threads", "1", "--page-tokens", "8,16", "--layers", "2", "--context", "100", "--rounds", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["page_tokens"] for r in result["runs"]] == [8, 16]
    for r in result["runs"]:
        assert set(r["ms"]) == {"dense_sdpa", "dense_native", "paged_run", "paged_scattered", "page_major_run",
                                "prerope_torch"}
        assert all(v > 0 for v in r["ms"].values()) and all(r["bitwise"].values())


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.has_cuda_ext()),
                                reason="needs a CUDA device and a KVBOOST_CUDA=1 build")
# fp32 as close to float64 as the CPU kernel's bound; fp16/bf16: the inputs rounded to the dtype, then float64,
# against the output's own rounding (a few units of the dtype's epsilon at |out| <= 3)
_CUDA_TOL = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", list(_CUDA_TOL), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_cuda_dense_and_paged_against_float64(shape, dtype):
    """The CUDA kernels (csrc/cuda/decode_attn.cu): the dense and the paged call agree bitwise on the same rows,
    both are within the dtype's tolerance of a float64 reference, and a second call gives the same bits."""
    h, kv, d, p_tok, n_pages, n = shape
    q, k_pool, v_pool, pages = (t.cuda() for t in _case(h, kv, d, p_tok, n_pages, n))
    q, k_pool, v_pool = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    scale = d ** -0.5
    assert ops.decode_kernel(q.device)
    got = ops.paged_decode_attention(q, k_pool, v_pool, pages, n, scale)
    again = ops.paged_decode_attention(q, k_pool, v_pool, pages, n, scale)
    kd, vd = _dense(k_pool, pages).contiguous(), _dense(v_pool, pages).contiguous()
    dense = ops.decode_attention(q, kd, vd, n, scale)
    assert got.dtype == dtype and got.shape == (h, d) and got.is_cuda
    assert torch.equal(got, again) and torch.equal(got, dense)
    exact = _float64(q.cpu(), kd.cpu(), vd.cpu(), n, scale)
    err = float((got.cpu().double() - exact).abs().max())
    assert err <= _CUDA_TOL[dtype], err


@pytest.mark.gpu
@needs_cuda
def test_cuda_bad_arguments_and_cpu_fp16_fall_back():
    q, k_pool, v_pool, pages = (t.cuda() for t in _case(4, 2, 16, 8, 20, 60))
    with pytest.raises(ValueError, match="page id"):
        torch.ops.kvboost.paged_decode_attention(q, k_pool, v_pool, pages + 100, 60, 0.25)
    with pytest.raises(ValueError, match="one dtype"):
        torch.ops.kvboost.paged_decode_attention(q.half(), k_pool, v_pool, pages, 60, 0.25)
    cpu = [t.cpu().half() for t in (q, k_pool, v_pool)]  # fp16 on the CPU: the reference, not the kernel
    assert torch.equal(ops.paged_decode_attention(*cpu, pages.cpu(), 60, 0.25),
                       reference.paged_decode_attention(*cpu, pages.cpu(), 60, 0.25))
