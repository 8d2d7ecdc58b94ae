// The kvboost op library: schemas (the contract shared by the CPU kernels, the CUDA kernels, the fake
// implementations in kvboost_core/kernels/ops.py and the torch reference) and their CPU/CUDA registrations.
//
// dequant_rerotate_into writes in place into the per-layer cache buffers, so they are declared mutable
// TensorLists (`Tensor(a!)[]`): the engine hands over its existing (1, H, T, D) buffers and nothing is
// allocated per call.
#include <Python.h>
#include <torch/library.h>

#include "kvboost.h"

TORCH_LIBRARY(kvboost, m) {
  m.def(
      "dequant_rerotate_into(Tensor(a!)[] dst_k, Tensor(b!)[] dst_v, Tensor k, Tensor v, Tensor? k_scale, "
      "Tensor? k_min, Tensor? v_scale, Tensor? v_min, int bits, int group_size, int head_dim, int src_start, "
      "int length, int dst_start, Tensor? cos, Tensor? sin) -> ()");
  m.def("quantize_kv(Tensor k, Tensor v, int bits, int group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("blend_select(Tensor fresh, Tensor cached, int k, Tensor? forced_mask) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, int length, float scale) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor pages, int length, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) {
  m.impl("dequant_rerotate_into", &kvboost::dequant_rerotate_into_cpu);
  m.impl("quantize_kv", &kvboost::quantize_kv_cpu);
  m.impl("blend_select", &kvboost::blend_select_cpu);
  m.impl("decode_attention", &kvboost::decode_attention_cpu);
  m.impl("paged_decode_attention", &kvboost::paged_decode_attention_cpu);
}

#ifdef KVBOOST_WITH_CUDA
TORCH_LIBRARY_IMPL(kvboost, CUDA, m) {
  m.impl("dequant_rerotate_into", &kvboost::dequant_rerotate_into_cuda);
  m.impl("quantize_kv", &kvboost::quantize_kv_cuda);
  m.impl("blend_select", &kvboost::blend_select_cuda);
  m.impl("decode_attention", &kvboost::decode_attention_cuda);
  m.impl("paged_decode_attention", &kvboost::paged_decode_attention_cuda);
}
#endif

// Importing kvboost_core._C registers the ops above (static initializers); the module itself only reports
// how it was built. Plain CPython API instead of pybind11/torch/extension.h: much faster to compile.
static struct PyModuleDef kvboost_module = {PyModuleDef_HEAD_INIT, "_C", "kvboost native kernels", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&kvboost_module);
  if (m == nullptr) return nullptr;
#ifdef KVBOOST_WITH_CUDA
  PyModule_AddObject(m, "with_cuda", Py_NewRef(Py_True));
#else
  PyModule_AddObject(m, "with_cuda", Py_NewRef(Py_False));
#endif
  return m;
}
