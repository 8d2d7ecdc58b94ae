// Argument validation shared by the CPU and CUDA implementations, so both reject the same inputs with the
// same messages (the Python fallback in kvboost_core/kernels/reference.py raises equivalent errors).
#include "../kvboost.h"

namespace kvboost {

static bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

PlaceGeometry check_place_args(at::TensorList dst_k, at::TensorList dst_v, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& k_min, const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& v_min, int64_t bits, int64_t group_size,
                               int64_t head_dim, int64_t src_start, int64_t length, int64_t dst_start,
                               const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  TORCH_CHECK_VALUE(bits == 16 || bits == 8 || bits == 4, "kvboost: bits must be 16 (dense), 8 or 4, got ", bits);
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
                    "kvboost: k/v must share one (L, H, n, D|Dc) shape, got ", k.sizes(), " and ", v.sizes());
  const int64_t L = k.size(0), H = k.size(1), n = k.size(2);
  int64_t D;
  const bool has_q = k_scale.has_value() || k_min.has_value() || v_scale.has_value() || v_min.has_value();
  if (bits == 16) {
    TORCH_CHECK_VALUE(!has_q, "kvboost: dense payload (bits=16) takes no scale/min tensors");
    TORCH_CHECK_VALUE(is_float_kind(k.scalar_type()) && is_float_kind(v.scalar_type()),
                      "kvboost: dense k/v must be float32/bfloat16/float16, got ", k.scalar_type(), " and ",
                      v.scalar_type());
    D = k.size(3);
  } else {
    TORCH_CHECK_VALUE(k_scale && k_min && v_scale && v_min, "kvboost: quantized payload needs all four scale/min tensors");
    TORCH_CHECK_VALUE(k.scalar_type() == at::kByte && v.scalar_type() == at::kByte, "kvboost: codes must be uint8");
    TORCH_CHECK_VALUE(group_size >= 1, "kvboost: group_size must be positive, got ", group_size);
    D = head_dim;
    const int64_t want_dc = bits == 8 ? D : ceil_div(D, 2);
    TORCH_CHECK_VALUE(k.size(3) == want_dc, "kvboost: codes last dim ", k.size(3), " does not match head_dim ", D,
                      " at ", bits, " bits");
    const std::vector<int64_t> ks{L, H, ceil_div(n, group_size), D};
    const std::vector<int64_t> vs{L, H, n, ceil_div(D, group_size)};
    for (auto [name, t, shape] : {std::make_tuple("k_scale", &*k_scale, &ks), std::make_tuple("k_min", &*k_min, &ks),
                                  std::make_tuple("v_scale", &*v_scale, &vs), std::make_tuple("v_min", &*v_min, &vs)}) {
      TORCH_CHECK_VALUE(t->scalar_type() == at::kHalf && t->sizes() == at::IntArrayRef(*shape), "kvboost: ", name,
                        " must be float16 ", at::IntArrayRef(*shape), ", got ", t->scalar_type(), " ", t->sizes());
      TORCH_CHECK_VALUE(t->device() == k.device(), "kvboost: ", name, " is on ", t->device(), ", codes on ", k.device());
    }
  }
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxHeadDim, "kvboost: head_dim must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK_VALUE(v.device() == k.device(), "kvboost: k and v are on different devices");
  TORCH_CHECK_VALUE(k.stride(3) == 1 && v.stride(3) == 1, "kvboost: k/v need a contiguous last dim");
  TORCH_CHECK_VALUE(src_start >= 0 && length >= 0 && src_start + length <= n, "kvboost: source tokens [", src_start,
                    ", ", src_start + length, ") out of range for a payload of ", n, " tokens");
  TORCH_CHECK_VALUE(static_cast<int64_t>(dst_k.size()) == L && static_cast<int64_t>(dst_v.size()) == L,
                    "kvboost: ", L, " payload layers but ", dst_k.size(), " key and ", dst_v.size(), " value buffers");
  int64_t T = -1;
  for (int64_t l = 0; l < 2 * L; ++l) {
    const at::Tensor& d = l < L ? dst_k[l] : dst_v[l - L];
    TORCH_CHECK_VALUE(d.dim() == 4 && d.size(0) == 1 && d.size(1) == H && d.size(3) == D,
                      "kvboost: destination buffers must be (1, ", H, ", T, ", D, "), got ", d.sizes());
    TORCH_CHECK_VALUE(is_float_kind(d.scalar_type()) && d.scalar_type() == dst_k[0].scalar_type(),
                      "kvboost: destination buffers must share one float dtype, got ", d.scalar_type());
    TORCH_CHECK_VALUE(d.device() == k.device(), "kvboost: destination buffer on ", d.device(), " but payload on ",
                      k.device(), " (move the payload first)");
    TORCH_CHECK_VALUE(d.stride(3) == 1, "kvboost: destination buffers need a contiguous last dim");
    if (T < 0) T = d.size(2);
    TORCH_CHECK_VALUE(d.size(2) == T, "kvboost: destination buffers differ in capacity");
  }
  TORCH_CHECK_VALUE(dst_start >= 0 && dst_start + length <= std::max<int64_t>(T, 0), "kvboost: destination slots [",
                    dst_start, ", ", dst_start + length, ") out of range for capacity ", T);
  TORCH_CHECK_VALUE(cos.has_value() == sin.has_value(), "kvboost: pass both cos and sin, or neither");
  int64_t R = 0;
  if (cos) {
    TORCH_CHECK_VALUE(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat,
                      "kvboost: cos/sin must be float32");
    TORCH_CHECK_VALUE(cos->dim() == 2 && cos->sizes() == sin->sizes() && cos->size(0) == length,
                      "kvboost: cos/sin must be (length=", length, ", R), got ", cos->sizes(), " and ", sin->sizes());
    R = cos->size(1);
    TORCH_CHECK_VALUE(R % 2 == 0 && R <= D, "kvboost: rotary dims R=", R, " must be even and <= head_dim ", D);
    TORCH_CHECK_VALUE(cos->device() == k.device() && sin->device() == k.device(),
                      "kvboost: cos/sin must be on the payload's device");
  }
  return PlaceGeometry{L, H, n, D, R, T, cos.has_value() && R > 0};
}

void check_quantize_args(const at::Tensor& k, const at::Tensor& v, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK_VALUE(group_size >= 1, "group_size must be a positive int, got ", group_size);
  TORCH_CHECK_VALUE(k.dim() == 4 && k.sizes() == v.sizes(), "keys/values must both be (L, H, n, D), got ", k.sizes(),
                    " and ", v.sizes());
  TORCH_CHECK_VALUE(is_float_kind(k.scalar_type()) && is_float_kind(v.scalar_type()),
                    "kvboost: quantize_kv takes float32/bfloat16/float16, got ", k.scalar_type());
  TORCH_CHECK_VALUE(k.device() == v.device(), "kvboost: k and v are on different devices");
}

int64_t check_blend_args(const at::Tensor& fresh, const at::Tensor& cached, int64_t k,
                         const std::optional<at::Tensor>& forced_mask) {
  TORCH_CHECK_VALUE(fresh.dim() == 3 && fresh.sizes() == cached.sizes(),
                    "kvboost: blend_select takes fresh/cached (H, n, D) of one shape, got ", fresh.sizes(), " and ",
                    cached.sizes());
  TORCH_CHECK_VALUE(is_float_kind(fresh.scalar_type()) && is_float_kind(cached.scalar_type()),
                    "kvboost: blend_select takes float32/bfloat16/float16");
  TORCH_CHECK_VALUE(fresh.device() == cached.device(), "kvboost: fresh and cached are on different devices");
  TORCH_CHECK_VALUE(k >= 0, "kvboost: k must be >= 0, got ", k);
  const int64_t n = fresh.size(1);
  if (forced_mask) {
    TORCH_CHECK_VALUE(forced_mask->scalar_type() == at::kBool && forced_mask->dim() == 1 && forced_mask->size(0) == n,
                      "kvboost: forced_mask must be bool (n=", n, "), got ", forced_mask->scalar_type(), " ",
                      forced_mask->sizes());
    TORCH_CHECK_VALUE(forced_mask->device() == fresh.device(), "kvboost: forced_mask on another device");
  }
  return n;
}

// What both decode attentions ask of q (H, D) and their K/V (head_dim D_kv, KV heads Hkv, rows along the last dim).
static DecodeGeometry check_decode_rows(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        int64_t Hkv, int64_t D_kv) {
  const at::ScalarType dt = q.scalar_type();  // float32; on CUDA float16/bfloat16 too (fp32 accumulation)
  const bool half = q.is_cuda() && (dt == at::kHalf || dt == at::kBFloat16);
  TORCH_CHECK_VALUE((dt == at::kFloat || half) && k.scalar_type() == dt && v.scalar_type() == dt,
                    "kvboost: ", op, " takes float32 q/k/v (float16/bfloat16 too on CUDA), all of one dtype");
  TORCH_CHECK_VALUE(q.device() == k.device() && k.device() == v.device(),
                    "kvboost: ", op, "'s q/k/v are on different devices");
  const int64_t H = q.size(0), D = q.size(1);
  TORCH_CHECK_VALUE(D_kv == D, "kvboost: ", op, "'s head_dim differs: q ", D, ", k/v ", D_kv);
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, "kvboost: query heads (", H, ") must be a multiple of KV heads (",
                    Hkv, ")");
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxHeadDim, "kvboost: head_dim must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK_VALUE(k.stride(-1) == 1 && v.stride(-1) == 1, "kvboost: ", op, " needs k/v rows contiguous");
  return {H, Hkv, D};
}

DecodeGeometry check_decode_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length) {
  TORCH_CHECK_VALUE(q.dim() == 2 && k.dim() == 3 && k.sizes() == v.sizes(),
                    "kvboost: decode_attention takes q (H, D) and k/v (H_kv, T, D) of one shape, got ", q.sizes(),
                    ", ", k.sizes(), " and ", v.sizes());
  const DecodeGeometry g = check_decode_rows("decode_attention", q, k, v, k.size(0), k.size(2));
  TORCH_CHECK_VALUE(length >= 1 && length <= k.size(1), "kvboost: length must be in [1, ", k.size(1), "], got ",
                    length);
  return g;
}

DecodeGeometry check_paged_decode_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                       const at::Tensor& pages, int64_t length) {
  TORCH_CHECK_VALUE(q.dim() == 2 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
                    "kvboost: paged_decode_attention takes q (H, D) and k_pool/v_pool (N, H_kv, P, D) of one shape, "
                    "got ", q.sizes(), ", ", k_pool.sizes(), " and ", v_pool.sizes());
  const DecodeGeometry g = check_decode_rows("paged_decode_attention", q, k_pool, v_pool, k_pool.size(1),
                                             k_pool.size(3));
  TORCH_CHECK_VALUE(pages.device() == q.device(), "kvboost: paged_decode_attention's pages are on another device");
  const int64_t N = k_pool.size(0), P = k_pool.size(2);
  TORCH_CHECK_VALUE(P >= 1, "kvboost: pages must hold at least one token");
  TORCH_CHECK_VALUE(pages.dim() == 1 && pages.scalar_type() == at::kLong,
                    "kvboost: pages must be a 1-D int64 tensor of page ids, got ", pages.scalar_type(), " ",
                    pages.sizes());
  TORCH_CHECK_VALUE(length >= 1 && length <= pages.size(0) * P, "kvboost: length must be in [1, ",
                    pages.size(0) * P, "] (", pages.size(0), " pages of ", P, "), got ", length);
  const at::Tensor used = pages.slice(0, 0, (length + P - 1) / P);
  TORCH_CHECK_VALUE(used.min().item<int64_t>() >= 0 && used.max().item<int64_t>() < N,
                    "kvboost: a page id is outside the pool's ", N, " pages");
  return g;
}

}  // namespace kvboost
