// Row-wise steps of a prefill layer, each one pass over its rows:
// RMSNorm before a projection (HF's float32 RMSNorm) and RoPE on the q/k heads of the fused
// qkv projection, rotated in place (HF's rotate_half convention). torch runs the first as
// five elementwise ops and the second as seven, each its own pass and its own OpenMP region;
// on a loaded 2-core machine every region waits for a descheduled thread. These run on the
// calling thread alone: measured on the kernels' spin pool (spin_pool.h) they made a prefill
// step slower, not faster (its waiting threads spun against oneDNN's team for the cores the
// matmuls need; bench/prefill.py). Called through kvfence.model.rows_cpu.
#include <cmath>
#include <cstdint>

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
