// omni_qwen_cpu::decode_attention: one layer's attention for a step of one-token decodes on a CPU, reading each
// request's context through its block table (no gather into a buffer), after writing the step's own K/V into the
// pool. Built at load by paged/kernel.py (ar_compile on a CPU) and called from the compiled decode step.
//
// One request per task: its blocks are walked in order and each block's K and V are read once (a block is one
// contiguous run of block_size * kv_heads * head_dim values), with the next block prefetched. Scores and the
// weighted sum are fp32, with a softmax that rescales as each block raises the running maximum. Within a block
// the loops go head by head, so a head's query and its accumulator stay in registers across the block's tokens.

// Tensor and the one op it calls (empty), not ATen/ATen.h, which declares every op: 6.9 s to build instead of
// 9.2 s here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// `n` values as floats (bf16 is the high half of an fp32).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
      float value;
      std::memcpy(&value, &widened, sizeof(float));
      dst[i] = value;
    }
  }
}

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

struct Shape {
  int64_t num_decodes, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_row, k_row, v_row;  // elements from one decode's q (k, v) to the next's: they may be views of a wider row
};

// kHeadDim > 0: head_dim known when compiling, so the loops over it unroll.
template <typename T, int64_t kHeadDim>
void attend(const T* q, const T* pool_k, const T* pool_v, const int64_t* blocks, const int64_t* positions, T* out,
            const Shape& shape) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : shape.head_dim;
  const int64_t num_heads = shape.num_heads, block_size = shape.block_size;
  const int64_t width = shape.num_kv_heads * head_dim, block_elems = block_size * width;
  const int64_t group = num_heads / shape.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  at::parallel_for(0, shape.num_decodes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(num_heads * head_dim), rows(block_size * width), acc(num_heads * head_dim);
    std::vector<float> scores(num_heads * block_size), top(num_heads), total(num_heads);
    std::vector<int64_t> offset(num_heads);  // where each query head's K/V head starts in a token's row
    for (int64_t h = 0; h < num_heads; ++h) offset[h] = (h / group) * head_dim;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t length = positions[b] + 1;
      const int64_t used = (length + block_size - 1) / block_size;
      const int64_t* table = blocks + b * shape.max_blocks;
      to_float(q + b * shape.q_row, queries.data(), num_heads * head_dim);
      for (auto& x : queries) x *= scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      // No infinities: the kernel is built with -ffast-math, which assumes none.
      std::fill(top.begin(), top.end(), std::numeric_limits<float>::lowest());
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t j = 0; j < used; ++j) {
        if (j + 1 < used) {
          prefetch(pool_k + table[j + 1] * block_elems, block_elems * sizeof(T));
          prefetch(pool_v + table[j + 1] * block_elems, block_elems * sizeof(T));
        }
        const int64_t n = std::min(block_size, length - j * block_size);
        to_float(pool_k + table[j] * block_elems, rows.data(), n * width);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = queries.data() + h * head_dim;
          float* sh = scores.data() + h * block_size;
          for (int64_t t = 0; t < n; ++t) {
            const float* kh = rows.data() + t * width + offset[h];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
            sh[t] = dot;
          }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          float* s = scores.data() + h * block_size;
          float high = top[h];
          for (int64_t t = 0; t < n; ++t) high = std::max(high, s[t]);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - high);
            sum += s[t];
          }
          if (high > top[h]) {  // what was summed so far shrinks by exp(old maximum - new maximum)
            const float shrink = std::exp(top[h] - high);
            float* a = acc.data() + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= shrink;
            total[h] *= shrink;
            top[h] = high;
          }
          total[h] += sum;
        }
        to_float(pool_v + table[j] * block_elems, rows.data(), n * width);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* sh = scores.data() + h * block_size;
          float* __restrict a = acc.data() + h * head_dim;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sh[t];
            const float* __restrict vh = rows.data() + t * width + offset[h];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* o = out + (b * num_heads + h) * head_dim;
        const float inverse = 1.f / total[h];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[h * head_dim + d] * inverse);
      }
    }
  });
}

template <typename T>
void attend_any(const T* q, const T* pool_k, const T* pool_v, const int64_t* blocks, const int64_t* positions,
                T* out, const Shape& shape) {
  switch (shape.head_dim) {
    case 64:
      attend<T, 64>(q, pool_k, pool_v, blocks, positions, out, shape);
      break;
    case 128:
      attend<T, 128>(q, pool_k, pool_v, blocks, positions, out, shape);
      break;
    default:
      attend<T, 0>(q, pool_k, pool_v, blocks, positions, out, shape);
  }
}

// The step's K/V (decodes, kv_heads, head_dim) into their slots of one layer's pool.
template <typename T>
void write(const T* k, const T* v, T* pool_k, T* pool_v, const int64_t* slots, const Shape& shape) {
  const int64_t width = shape.num_kv_heads * shape.head_dim;
  for (int64_t b = 0; b < shape.num_decodes; ++b) {
    std::memcpy(pool_k + slots[b] * width, k + b * shape.k_row, width * sizeof(T));
    std::memcpy(pool_v + slots[b] * width, v + b * shape.v_row, width * sizeof(T));
  }
}

// Write this step's K/V into the layer's pool (starting at `start`), then attend.
template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv, int64_t start,
         int64_t layer_elems, const at::Tensor& slots, const at::Tensor& blocks, const at::Tensor& positions,
         at::Tensor& out, const Shape& shape) {
  T* pool_k = kv.data_ptr<T>() + start;
  T* pool_v = pool_k + layer_elems;
  write(k.data_ptr<T>(), v.data_ptr<T>(), pool_k, pool_v, slots.data_ptr<int64_t>(), shape);
  attend_any(q.data_ptr<T>(), pool_k, pool_v, blocks.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
             out.data_ptr<T>(), shape);
}

// `t` itself when each row's (heads, head_dim) values are contiguous (rows may be a wider stride apart), else a
// contiguous copy.
at::Tensor rows_in_place(const at::Tensor& t) {
  if (t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) && t.stride(0) >= t.size(1) * t.size(2)) return t;
  return t.contiguous();
}

// q (decodes, heads, head_dim), k and v (decodes, kv_heads, head_dim); kv the whole pool (layers, 2, blocks,
// block_size, kv_heads, head_dim); slots (decodes) where this step's K/V go; blocks (decodes * max_blocks), each
// request's block table padded; positions (decodes), each decode's position. Returns (decodes, heads * head_dim).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv,
                            int64_t layer, const at::Tensor& slots, const at::Tensor& blocks,
                            const at::Tensor& positions) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous(), "decode_attention: kv must be a contiguous 6-d pool");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && k.scalar_type() == kv.scalar_type() &&
                  v.scalar_type() == kv.scalar_type(), "decode_attention: q, k, v and kv must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong, "decode_attention: slots, blocks, positions must be int64");
  // The compiled step passes q and k as views of rope's (decodes, heads + kv_heads, head_dim) output and v of the
  // q/k/v matmul's: each decode's heads are contiguous, the decodes a wider row apart. Read in place (no copy);
  // any other layout is made contiguous first.
  const at::Tensor qc = rows_in_place(q), kc = rows_in_place(k), vc = rows_in_place(v);
  const at::Tensor slots_c = slots.contiguous(), blocks_c = blocks.contiguous(), positions_c = positions.contiguous();
  Shape shape{qc.size(0), qc.size(1), kv.size(4), kv.size(5), kv.size(3), 0, qc.stride(0), kc.stride(0), vc.stride(0)};
  shape.max_blocks = shape.num_decodes ? blocks_c.numel() / shape.num_decodes : 0;
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0, "decode_attention: heads must be a multiple of kv heads");
  // What the loops index with: every position within its padded table, every block and slot within the pool.
  TORCH_CHECK(layer >= 0 && layer < kv.size(0), "decode_attention: no layer ", layer);
  TORCH_CHECK(qc.dim() == 3 && kc.dim() == 3 && vc.dim() == 3 && qc.size(2) == shape.head_dim &&
                  kc.size(1) == shape.num_kv_heads && kc.size(2) == shape.head_dim &&
                  vc.size(1) == shape.num_kv_heads && vc.size(2) == shape.head_dim,
              "decode_attention: q, k and v must be (decodes, heads, head_dim) with the pool's K/V heads and head_dim");
  TORCH_CHECK(kc.size(0) == shape.num_decodes && vc.size(0) == shape.num_decodes && slots_c.numel() ==
                  shape.num_decodes && positions_c.numel() == shape.num_decodes,
              "decode_attention: q, k, v, slots and positions must have one row per decode");
  const int64_t num_blocks = kv.size(2);
  const int64_t* table = blocks_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < shape.num_decodes; ++b) {
    const int64_t position = positions_c.data_ptr<int64_t>()[b], slot = slots_c.data_ptr<int64_t>()[b];
    TORCH_CHECK(position >= 0 && position < shape.max_blocks * shape.block_size,
                "decode_attention: a position beyond its block table");
    TORCH_CHECK(slot >= 0 && slot < num_blocks * shape.block_size, "decode_attention: a slot outside the pool");
    for (int64_t j = 0; j <= position / shape.block_size; ++j) {
      const int64_t block = table[b * shape.max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention: a block outside the pool");
    }
  }
  auto out = at::empty({shape.num_decodes, shape.num_heads * shape.head_dim}, qc.options());
  const int64_t layer_elems = kv.size(2) * kv.size(3) * kv.size(4) * kv.size(5);
  if (kv.scalar_type() == at::kFloat) {
    run<float>(qc, kc, vc, kv, layer * 2 * layer_elems, layer_elems, slots_c, blocks_c, positions_c, out, shape);
  } else if (kv.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(qc, kc, vc, kv, layer * 2 * layer_elems, layer_elems, slots_c, blocks_c, positions_c, out,
                       shape);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16, not ", kv.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(omni_qwen_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv, int layer, Tensor slots, Tensor blocks, "
        "Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(omni_qwen_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
