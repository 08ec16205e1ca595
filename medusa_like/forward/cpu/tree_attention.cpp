// Row-invariant attention for the compiled tree step: see tree_attention.py for the contract.
//
// Every output row is computed from its own query and the keys it sees, visited in slot order, by one fixed sequence
// of float operations: nothing depends on the other rows, on how many slots there are, or on where the masked ones
// sit. Vectors are GCC's vector extensions (16 floats; the compiler lowers them to AVX-512, AVX2 or SSE), and the
// build passes -ffp-contract=off, so the same source gives the same bits whether an operation lands in a wide or a
// narrow register.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat splat(float x) { return vfloat{} + x; }

// `n` (up to 16) consecutive values as floats, the lanes past them 0
inline vfloat load(const float* p, int n = kLanes) {
  vfloat v{};
  if (n == kLanes) std::memcpy(&v, p, sizeof(v));  // a constant size: one vector load
  else std::memcpy(&v, p, n * sizeof(float));
  return v;
}
inline vfloat load(const c10::BFloat16* p, int n = kLanes) {
  vhalf h{};
  if (n == kLanes) std::memcpy(&h, p, sizeof(h));
  else std::memcpy(&h, p, n * sizeof(uint16_t));
  vuint wide = __builtin_convertvector(h, vuint) << 16;  // a bf16 is the top half of the float it rounds
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// the sum of the 16 lanes, halves added pairwise (one order for every key)
inline float lane_sum(vfloat v) {
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
  typedef float v2 __attribute__((vector_size(2 * sizeof(float))));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

// exp(x) lane by lane for x <= 0 (-inf included, giving 0), in plain float arithmetic: Cody-Waite reduction
// x = n ln2 + r, then Cephes' expf polynomial of r (a few units in the last place); 0 below -87
inline vfloat exp_nonpositive(vfloat x) {
  const vint live = x > -87.0f;
  x = live ? x : splat(-87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vfloat n = (x * 1.44269504088896341f + shifter) - shifter;
  vfloat r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return live ? p * scale : splat(0.0f);
}

template <typename T>
inline void store(T* out, vfloat v, int n) {
  for (int i = 0; i < n; ++i) out[i] = static_cast<T>(v[i]);
}

// C: vectors a head's row takes (head_dim D = 16 (C - 1) + its last vector's width)
template <typename T, int C>
void attend(const T* q, const T* k, const T* v, const bool* visible, T* out, int64_t batch, int64_t heads,
            int64_t kv_heads, int64_t rows, int64_t keys, int64_t D, float scale) {
  const int tail = static_cast<int>(D - (C - 1) * kLanes);  // the last vector's width, 1..16
  const int64_t group = heads / kv_heads;
  const int64_t padded = (keys + kLanes - 1) / kLanes * kLanes;  // room for a row's scores, whole vectors
  // one item per (sequence, key head, row): a sequence of a batch is computed as it would be alone
  at::parallel_for(0, batch * kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> seen_keys(keys);
    std::vector<float> scores(padded);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * rows), kvh = item / rows % kv_heads, t = item % rows;
      const T* kh = k + (b * kv_heads + kvh) * keys * D;
      const T* vh = v + (b * kv_heads + kvh) * keys * D;
      const bool* seen = visible + b * rows * keys;
      int64_t n = 0;  // the keys row t sees, in slot order: its ancestors' and the committed ones, in position order
      for (int64_t j = 0; j < keys; ++j)
        if (seen[t * keys + j]) seen_keys[n++] = j;
      const int64_t n_padded = (n + kLanes - 1) / kLanes * kLanes;
      for (int64_t g = 0; g < group; ++g) {  // the group's heads one after another, over the same keys
        const T* row = q + (((b * kv_heads + kvh) * group + g) * rows + t) * D;
        vfloat query[C];
        for (int c = 0; c < C; ++c) query[c] = load(row + c * kLanes, c == C - 1 ? tail : kLanes);
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) {  // each seen key's score (its D products in one order), and the maximum
          const T* key = kh + seen_keys[i] * D;
          vfloat prod = query[0] * load(key, C == 1 ? tail : kLanes);
          for (int c = 1; c < C; ++c) prod = prod + query[c] * load(key + c * kLanes, c == C - 1 ? tail : kLanes);
          const float score = lane_sum(prod) * scale;
          scores[i] = score;
          top = score > top ? score : top;
        }
        for (int64_t i = n; i < n_padded; ++i) scores[i] = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n_padded; i += kLanes) {  // the weights, 16 at a time (the padding's: exactly 0)
          const vfloat weight = exp_nonpositive(load(&scores[i]) - top);
          std::memcpy(&scores[i], &weight, sizeof(weight));
        }
        // the weights' sum and the weighted values: two running sums, the seen keys alternating between them by
        // rank (the same ranks in a tree as in a one-node step), so that consecutive keys' additions overlap
        vfloat even[C] = {}, odd[C] = {};
        float even_total = 0.0f, odd_total = 0.0f;
        int64_t i = 0;
        for (; i + 1 < n; i += 2) {
          const T* v0 = vh + seen_keys[i] * D;
          const T* v1 = vh + seen_keys[i + 1] * D;
          const float p0 = scores[i], p1 = scores[i + 1];
          even_total = even_total + p0;
          odd_total = odd_total + p1;
          for (int c = 0; c < C; ++c) {
            even[c] = even[c] + p0 * load(v0 + c * kLanes, c == C - 1 ? tail : kLanes);
            odd[c] = odd[c] + p1 * load(v1 + c * kLanes, c == C - 1 ? tail : kLanes);
          }
        }
        if (i < n) {
          const T* v0 = vh + seen_keys[i] * D;
          even_total = even_total + scores[i];
          for (int c = 0; c < C; ++c) even[c] = even[c] + scores[i] * load(v0 + c * kLanes, c == C - 1 ? tail : kLanes);
        }
        T* out_row = out + (((b * kv_heads + kvh) * group + g) * rows + t) * D;
        const float inv = 1.0f / (even_total + odd_total);  // >= 1: the maximum's own weight
        for (int c = 0; c < C; ++c) store(out_row + c * kLanes, (even[c] + odd[c]) * inv, c == C - 1 ? tail : kLanes);
      }
    }
  });
}

at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& visible, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && visible.dim() == 4,
              "tree_attention: query [B, H, T, D], key and value [B, H_kv, S, D], visible [B, 1, T, S]");
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), keys = key.size(2);
  TORCH_CHECK(key.size(0) == batch && visible.size(0) == batch && visible.size(1) == 1,
              "tree_attention: query, key, value and visible must share the batch size B (visible [B, 1, T, S])");
  TORCH_CHECK(heads % kv_heads == 0, "tree_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(value.sizes() == key.sizes() && key.size(3) == dim, "tree_attention: key and value must be [B, H_kv, S, D]");
  TORCH_CHECK(visible.size(2) == rows && visible.size(3) == keys, "tree_attention: visible must be [B, 1, T, S]");
  TORCH_CHECK(visible.scalar_type() == at::kBool, "tree_attention: visible must be a bool mask");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "tree_attention: query, key and value must share a dtype");
  TORCH_CHECK(query.device().is_cpu(), "tree_attention: CPU tensors only");
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous(), seen = visible.contiguous();
  auto out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  const float s = static_cast<float>(scale);
  const bool* m = seen.data_ptr<bool>();
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "tree_attention: float32 or bfloat16, got ", query.scalar_type());
  const int chunks = static_cast<int>((dim + kLanes - 1) / kLanes);
#define MEDUSA_LIKE_ATTEND(T, C)                                                                                      \
  case C:                                                                                                             \
    attend<T, C>(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), m, out.data_ptr<T>(), batch, heads, kv_heads,    \
                 rows, keys, dim, s);                                                                                 \
    break;
#define MEDUSA_LIKE_CHUNKS(T)                                                                                         \
  switch (chunks) {                                                                                                   \
    MEDUSA_LIKE_ATTEND(T, 1) MEDUSA_LIKE_ATTEND(T, 2) MEDUSA_LIKE_ATTEND(T, 3) MEDUSA_LIKE_ATTEND(T, 4)               \
    MEDUSA_LIKE_ATTEND(T, 5) MEDUSA_LIKE_ATTEND(T, 6) MEDUSA_LIKE_ATTEND(T, 7) MEDUSA_LIKE_ATTEND(T, 8)               \
    MEDUSA_LIKE_ATTEND(T, 16)                                                                                         \
    default: TORCH_CHECK(false, "tree_attention: head_dim 1..128 or 241..256, got ", dim);                        \
  }
  if (query.scalar_type() == at::kFloat) {
    MEDUSA_LIKE_CHUNKS(float)
  } else {
    MEDUSA_LIKE_CHUNKS(c10::BFloat16)
  }
#undef MEDUSA_LIKE_CHUNKS
#undef MEDUSA_LIKE_ATTEND
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(medusa_like, m) {
  m.def("tree_attention(Tensor query, Tensor key, Tensor value, Tensor visible, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(medusa_like, CPU, m) { m.impl("tree_attention", &tree_attention); }
