// CacheBlend token selection on CPU.
// dev[i] = sum over heads h and dims d of float32(fresh - cached)^2, accumulated in float64 (so the order of
// summation cannot flip a ranking except on exact ties). Order: forced tokens first, then larger dev, then
// lower index (NaN ranks above every number, like torch.topk). The first max(k, n_forced) tokens (at most n)
// are returned as int64 positions sorted ascending.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "../kvboost.h"
#include "convert.h"

namespace kvboost {
namespace {

template <typename A, typename B>
static void deviation(const at::Tensor& f, const at::Tensor& c, std::vector<double>& dev) {
  const int64_t H = f.size(0), n = f.size(1), D = f.size(2);
  const A* fp = f.data_ptr<A>();
  const B* cp = c.data_ptr<B>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double acc = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = (h * n + i) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float diff = Cvt<A>::load(fp[off + d]) - Cvt<B>::load(cp[off + d]);
          acc += static_cast<double>(diff * diff);
        }
      }
      dev[i] = acc;
    }
  });
}

template <typename F>
static void dispatch2(at::ScalarType a, at::ScalarType b, F&& f) {
  auto inner = [&](auto ta) {
    switch (b) {
      case at::kFloat: return f(ta, float{});
      case at::kBFloat16: return f(ta, c10::BFloat16{});
      case at::kHalf: return f(ta, c10::Half{});
      default: TORCH_CHECK(false, "kvboost: unsupported dtype ", b);
    }
  };
  switch (a) {
    case at::kFloat: return inner(float{});
    case at::kBFloat16: return inner(c10::BFloat16{});
    case at::kHalf: return inner(c10::Half{});
    default: TORCH_CHECK(false, "kvboost: unsupported dtype ", a);
  }
}

}  // namespace

at::Tensor blend_select_cpu(const at::Tensor& fresh_in, const at::Tensor& cached_in, int64_t k,
                            const std::optional<at::Tensor>& forced_mask) {
  const int64_t n = check_blend_args(fresh_in, cached_in, k, forced_mask);
  const at::Tensor fresh = fresh_in.contiguous(), cached = cached_in.contiguous();
  std::vector<double> dev(n);
  dispatch2(fresh.scalar_type(), cached.scalar_type(),
            [&](auto a, auto b) { deviation<decltype(a), decltype(b)>(fresh, cached, dev); });
  std::vector<uint8_t> forced(n, 0);
  if (forced_mask) {
    const at::Tensor fm = forced_mask->contiguous();
    const bool* p = fm.data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i) forced[i] = p[i];
  }
  const int64_t n_forced = std::count(forced.begin(), forced.end(), uint8_t(1));
  const int64_t take = std::min(n, std::max(k, n_forced));
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](int64_t i, int64_t j) {  // strict weak order: forced, NaN, larger dev, lower index
    if (forced[i] != forced[j]) return forced[i] > forced[j];
    const bool ni = std::isnan(dev[i]), nj = std::isnan(dev[j]);
    if (ni != nj) return ni;
    if (!ni && dev[i] != dev[j]) return dev[i] > dev[j];
    return i < j;
  };
  if (take < n) std::nth_element(order.begin(), order.begin() + take, order.end(), before);
  order.resize(take);
  std::sort(order.begin(), order.end());
  at::Tensor out = at::empty({take}, fresh.options().dtype(at::kLong));
  std::copy(order.begin(), order.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace kvboost
