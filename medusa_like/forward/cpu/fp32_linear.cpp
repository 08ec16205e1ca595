// fp32 products of a tree step's few rows by fused multiply-adds: see fp32_linear.py for the contract.
//
// The weight comes packed in blocks of 32 outputs: packed [N / 32, K, 32], so that one k of 32 outputs is two
// AVX512 vectors (or four AVX2 ones), multiplied by the row's value at k, broadcast. Each output is one fp32 sum over k
// in order, one fused multiply-add a step, whatever the row count, the rows beside it, the thread that computes it or
// the vector width: a row gets the same bits in any product, on AVX512 and AVX2 CPUs alike. Threads split the output
// blocks; a block's weights (K x 32 fp32, under 200 KB) stay in cache while the rows' register blocks pass over them.
//
// Both widths are compiled into one library (function target attributes); `fp32_linear` runs AVX512 where the CPU has
// it, else AVX2, and `fp32_linear_avx2` runs AVX2 anywhere (what an AVX2-only CPU computes, for tests here).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlockN = 32;  // outputs of a packed block

// rows [M] of x (row stride ldx) times one packed block w [K, 32] -> the block's `width` outputs of each row in y (row
// stride ldy), plus bias (the block's 32, or null)
using BlockFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t);

// AVX512: two vectors of 16 sums a row, 8 rows a register block (16 accumulators)
constexpr int kRows512 = 8;

template <int M>
__attribute__((target("avx512f"))) void block_avx512(const float* x, int64_t ldx, int64_t K, const float* w,
                                                     const float* bias, float* y, int64_t ldy, int64_t width) {
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

// AVX2: four vectors of 8 sums a row, 3 rows a register block (12 accumulators of the 16 registers)
constexpr int kRows256 = 3;

template <int M>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t ldx, int64_t K, const float* w,
                                                    const float* bias, float* y, int64_t ldy, int64_t width) {
  __m256 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kBlockN;
    for (int m = 0; m < M; ++m) {
      const __m256 a = _mm256_set1_ps(x[m * ldx + k]);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm256_fmadd_ps(a, _mm256_loadu_ps(wk + 8 * v), acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float sums[kBlockN];
    for (int v = 0; v < 4; ++v) {
      __m256 s = acc[m][v];
      if (bias != nullptr) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * v));
      _mm256_storeu_ps(sums + 8 * v, s);
    }
    std::memcpy(y + m * ldy, sums, width * sizeof(float));
  }
}

constexpr BlockFn kAvx512[kRows512 + 1] = {nullptr,          block_avx512<1>, block_avx512<2>,
                                           block_avx512<3>, block_avx512<4>, block_avx512<5>,
                                           block_avx512<6>, block_avx512<7>, block_avx512<8>};
constexpr BlockFn kAvx2[kRows256 + 1] = {nullptr, block_avx2<1>, block_avx2<2>, block_avx2<3>};

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                   int64_t out_features, bool wide) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "fp32_linear: this CPU has no AVX2 fused multiply-add");
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
  const BlockFn* kernels = wide ? kAvx512 : kAvx2;
  const int64_t rows_a_block = wide ? kRows512 : kRows256;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN, width = std::min(kBlockN, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += rows_a_block) {
        const int64_t rows_here = std::min(rows_a_block, M - m0);
        kernels[rows_here](xp + m0 * K, K, K, wp + nb * block_elems, bp ? bp + n0 : nullptr, yp + m0 * N + n0, N,
                           width);
      }
    }
  });
  return y;
}

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  return product(x, packed, bias, out_features, __builtin_cpu_supports("avx512f"));
}

at::Tensor fp32_linear_avx2(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  return product(x, packed, bias, out_features, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(medusa_like, m) {
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("fp32_linear_avx2(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(medusa_like, CPU, m) {
  m.impl("fp32_linear", fp32_linear);
  m.impl("fp32_linear_avx2", fp32_linear_avx2);
}
