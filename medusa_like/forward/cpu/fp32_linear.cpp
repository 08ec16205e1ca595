// fp32 products of a tree step's few rows by AVX512 fused multiply-adds: see fp32_linear.py for the contract.
//
// The weight comes packed in blocks of 32 outputs: packed [N / 32, K, 32], so that two 64-byte loads hold one k of 32
// outputs, multiplied by the row's value at k, broadcast. Each output is one fp32 sum over k in order, whatever the
// row count, the rows beside it or the thread that computes it: a row gets the same bits in any product. Threads split
// the output blocks; a block's weights (K x 32 fp32, under 200 KB) stay in cache while the rows' register blocks pass
// over them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kBlockN = 32;  // outputs of a packed block: two vectors of 16 fp32 sums
constexpr int kBlockM = 8;       // rows of a register block: 16 accumulators

#ifdef __AVX512F__
// rows [M] of x (row stride ldx) times one packed block w [K, 32] -> the block's `width` outputs of each row in y (row
// stride ldy), plus bias (the block's 32, or null)
template <int M>
void block_product(const float* x, int64_t ldx, int64_t K, const float* w, const float* bias, float* y, int64_t ldy,
                   int64_t width) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(w + k * kBlockN);
    const __m512 b1 = _mm512_loadu_ps(w + k * kBlockN + 16);
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
    }
  }
  const __mmask16 mask0 = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 mask1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
  for (int m = 0; m < M; ++m) {
    __m512 s0 = acc[m][0], s1 = acc[m][1];
    if (bias != nullptr) {
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(bias));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(bias + 16));
    }
    _mm512_mask_storeu_ps(y + m * ldy, mask0, s0);
    _mm512_mask_storeu_ps(y + m * ldy + 16, mask1, s1);
  }
}

using BlockFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t);
constexpr BlockFn kBlocks[kBlockM + 1] = {nullptr,           block_product<1>, block_product<2>,
                                          block_product<3>, block_product<4>, block_product<5>,
                                          block_product<6>, block_product<7>, block_product<8>};
#endif

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
#ifndef __AVX512F__
  TORCH_CHECK(false, "fp32_linear: built for a CPU without AVX512F");
#else
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "fp32_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "fp32_linear: x and packed must be float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.is_contiguous(),
              "fp32_linear: packed must be a contiguous [N / 32, K, 32] pack (fp32_linear.pack)");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(packed.size(1) == K && packed.size(0) == (N + kBlockN - 1) / kBlockN, "fp32_linear: a pack of ",
              packed.sizes(), " is not of a [", N, ", ", K, "] weight");
  at::Tensor bias_padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "fp32_linear: bias of ", bias->numel(), " values for ", N, " outputs");
    // padded to whole blocks, so that a block's 32 loads stay inside
    bias_padded = at::zeros({packed.size(0) * kBlockN}, x.options());
    bias_padded.narrow(0, 0, N).copy_(*bias);
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = rows.size(0), blocks = packed.size(0), block_elems = K * kBlockN;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty(out_sizes, x.options());  // [..., N]
  if (M == 0) return y;
  const float* xp = rows.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN, width = std::min(kBlockN, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
        const int rows_here = static_cast<int>(std::min<int64_t>(kBlockM, M - m0));
        kBlocks[rows_here](xp + m0 * K, K, K, wp + nb * block_elems, bp ? bp + n0 : nullptr, yp + m0 * N + n0, N,
                           width);
      }
    }
  });
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(medusa_like, m) {
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(medusa_like, CPU, m) { m.impl("fp32_linear", fp32_linear); }
