// bf16 products of a tree step's few rows by AVX512-BF16 dot products: see bf16_linear.py for the contract.
//
// The weight comes packed in blocks of 32 outputs, K in pairs: packed [N / 32, K / 2, 32, 2], so that one 64-byte
// load holds one k-pair of 16 outputs, the operand `vdpbf16ps` multiplies with the row's pair, broadcast. Each output
// is one fp32 sum over k-pairs in order, whatever the row count, the rows beside it or the thread that computes it: a
// row gets the same bits in any product. Threads split the output blocks; a block's weights (K x 32 bf16, under
// 100 KB) stay in cache while the rows' register blocks pass over them.
//
// Where the CPU has AMX (built with -march=native there, and the kernel grants this process the tile registers), a
// weight whose K is a whole number of 32s is multiplied by tiles instead: `tdpbf16ps` over 16 rows x 32 k of x and
// the same pack read as two 16-pair x 16-output tiles (a pack's k-pair row of 32 outputs is two tile rows of 64
// bytes). Each output row of a tile product depends on its own row of x alone, and the k-chunks are summed in order,
// so a row still gets the same bits at any row count; a layer's path depends on its K and the machine, never on the
// rows. A tile product takes 16 rows for about the price of one: 16 to 64 rows cost little more than one does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define MEDUSA_LIKE_AMX 1
#endif

namespace {

constexpr int64_t kBlockN = 32;  // outputs of a packed block: two vectors of 16 fp32 sums
constexpr int kBlockM = 8;       // rows of a register block: 16 accumulators

// one row's 32 sums of a block (two vectors), plus bias (the block's 32, fp32, or null), rounded to bf16 into the
// block's first `width` outputs of y
inline void store_block_row(__m512 s0, __m512 s1, const float* bias, uint16_t* y, int64_t width) {
  const __mmask16 mask0 = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 mask1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
  if (bias != nullptr) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(bias));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(bias + 16));
  }
  _mm256_mask_storeu_epi16(y, mask0, (__m256i)_mm512_cvtneps_pbh(s0));
  _mm256_mask_storeu_epi16(y + 16, mask1, (__m256i)_mm512_cvtneps_pbh(s1));
}

// rows [M] of x (row stride ldx) times one packed block w [K / 2, 32, 2] -> the block's `width` outputs of each row in
// y (row stride ldy), plus bias (the block's 32, fp32, or null), rounded to bf16
template <int M>
void block_product(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* w, const float* bias, uint16_t* y,
                   int64_t ldy, int64_t width) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * kBlockN);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + p * 2 * kBlockN + kBlockN);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], b0, a);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b1, a);
    }
  }
  if (K & 1) {  // the last k alone, its pair's other half 0 (as the pack's padding)
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + pairs * 2 * kBlockN);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + pairs * 2 * kBlockN + kBlockN);
    for (int m = 0; m < M; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[m * ldx + K - 1]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], b0, a);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b1, a);
    }
  }
  for (int m = 0; m < M; ++m) store_block_row(acc[m][0], acc[m][1], bias, y + m * ldy, width);
}

#ifdef MEDUSA_LIKE_AMX
constexpr int kTileRows = 16;  // rows of x a tile product takes
constexpr int kTileK = 32;     // k of x a tile row holds (64 bytes of bf16)

// Linux hands a process the tile registers only when asked (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); once per
// process, whichever thread asks first
bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1: the sums of `rows` rows x 16 outputs each; 2: `rows` rows x 32 k of x; 3, 4: 16 k-pairs x 16 outputs
void configure_tiles(int rows) {
  TileConfig config;
  for (int t : {0, 1, 2}) config.rows[t] = static_cast<uint8_t>(rows), config.colsb[t] = 64;
  for (int t : {3, 4}) config.rows[t] = kTileRows, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// the rows [m0, m0 + rows) of x [M, K] times one packed block w [K / 2, 32, 2] by tiles (K a multiple of 32), then
// as block_product: plus bias, rounded to bf16 into y's block of `width` outputs
void tile_block_product(const uint16_t* x, int64_t K, const uint16_t* w, const float* bias, uint16_t* y,
                        int64_t ldy, int64_t width, int rows) {
  alignas(64) float sums[kTileRows][kBlockN];
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    const uint16_t* wk = w + (k0 / 2) * 2 * kBlockN;  // the block's k-pairs k0 / 2 .. k0 / 2 + 15
    _tile_loadd(2, x + k0, K * 2);
    _tile_loadd(3, wk, 2 * kBlockN * 2);
    _tile_loadd(4, wk + kBlockN, 2 * kBlockN * 2);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, &sums[0][0], kBlockN * 4);
  _tile_stored(1, &sums[0][16], kBlockN * 4);
  for (int m = 0; m < rows; ++m)
    store_block_row(_mm512_load_ps(&sums[m][0]), _mm512_load_ps(&sums[m][16]), bias, y + m * ldy, width);
}
#endif

// whether a product over K runs on tiles here (AMX built in and granted, K a multiple of 32)
bool runs_on_tiles(int64_t K) {
#ifdef MEDUSA_LIKE_AMX
  return K % kTileK == 0 && tiles_granted();
#else
  (void)K;
  return false;
#endif
}

using BlockFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, uint16_t*, int64_t, int64_t);
constexpr BlockFn kBlocks[kBlockM + 1] = {nullptr,           block_product<1>, block_product<2>,
                                          block_product<3>, block_product<4>, block_product<5>,
                                          block_product<6>, block_product<7>, block_product<8>};

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: x and packed must be bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlockN && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_linear: packed must be a contiguous [N / 32, K / 2, 32, 2] pack (bf16_linear.pack)");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(packed.size(1) == (K + 1) / 2 && packed.size(0) == (N + kBlockN - 1) / kBlockN,
              "bf16_linear: a pack of ", packed.sizes(), " is not of a [", N, ", ", K, "] weight");
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias of ", bias->numel(), " values for ", N, " outputs");
    // padded to whole blocks, so that a block's 32 loads stay inside
    bias_f32 = at::zeros({packed.size(0) * kBlockN}, x.options().dtype(at::kFloat));
    bias_f32.narrow(0, 0, N).copy_(*bias);
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = rows.size(0), blocks = packed.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty(out_sizes, x.options());  // [..., N]
  const auto* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  const int64_t block_elems = packed.size(1) * 2 * kBlockN;
  if (M == 0) return y;
#ifdef MEDUSA_LIKE_AMX
  if (runs_on_tiles(K)) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      int configured = 0;  // the row count this thread's tiles are configured for
      for (int64_t nb = begin; nb < end; ++nb) {
        const int64_t n0 = nb * kBlockN, width = std::min(kBlockN, N - n0);
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
          const int rows_here = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
          if (rows_here != configured) configure_tiles(configured = rows_here);
          tile_block_product(xp + m0 * K, K, wp + nb * block_elems, bp ? bp + n0 : nullptr, yp + m0 * N + n0, N,
                             width, rows_here);
        }
      }
      if (configured != 0) _tile_release();
    });
    return y;
  }
#endif
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
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(medusa_like, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("bf16_linear_on_tiles(int in_features) -> bool", runs_on_tiles);
}

TORCH_LIBRARY_IMPL(medusa_like, CPU, m) { m.impl("bf16_linear", bf16_linear); }
