// Row-wise steps of a prefill layer, each one pass over its rows:
// RMSNorm before a projection (HF's float32 RMSNorm), RoPE on the q/k heads of the fused
// qkv projection, rotated in place (HF's rotate_half convention), and the new K/V rows
// written into their slots (torch's index_copy_: one OpenMP region per call, 100-150 us
// each on 2 cores under OMP_WAIT_POLICY=PASSIVE, two a layer). torch runs the first as
// five elementwise ops and the second as seven, each its own pass and its own OpenMP region;
// on a loaded 2-core machine every region waits for a descheduled thread. These run on the
// calling thread alone: measured on the kernels' spin pool (spin_pool.h) they made a prefill
// step slower, not faster (its waiting threads spun against oneDNN's team for the cores the
// matmuls need; bench/prefill.py). Called through kvfence.model.rows_cpu.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

extern "C" void kvf_rms_norm(const float* x, const float* w, float* out, int64_t T, int64_t H,
                             float eps) {
  for (int64_t t = 0; t < T; ++t) kvf::rms_normed(x + t * H, w, eps, out + t * H, H);
}

// x: T rows of `stride` floats; heads 0..H-1 of D floats each at the row's start are rotated.
// cos, sin: [T, D/2].
extern "C" void kvf_rope(float* x, int64_t T, int64_t stride, int64_t H, int64_t D,
                         const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < H; ++h) {
      float* x1 = x + t * stride + h * D;
      float* x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
}

// A layer's new K and V rows into the pool's slots: token t's row of `width` floats
// (KVH * D) goes to slot slot[t], at slot[t] * width of k_pool / v_pool. Source rows lie
// `stride` floats apart (views into the step's fused projection, read in place). Every slot
// is checked against the pool's `slots` before anything is written: 1, nothing written, if
// one lies outside it.
extern "C" int kvf_write_kv(const float* k, const float* v, int64_t T, int64_t stride,
                            int64_t width, const int64_t* slot, int64_t slots, float* k_pool,
                            float* v_pool) {
  for (int64_t t = 0; t < T; ++t)
    if (slot[t] < 0 || slot[t] >= slots) return 1;
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(k_pool + slot[t] * width, k + t * stride, width * sizeof(float));
    std::memcpy(v_pool + slot[t] * width, v + t * stride, width * sizeof(float));
  }
  return 0;
}
