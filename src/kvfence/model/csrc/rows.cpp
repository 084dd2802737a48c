// Row-wise steps of a prefill layer, each one pass over its rows in one parallel region:
// RMSNorm before a projection (HF's float32 RMSNorm) and RoPE on the q/k heads of the fused
// qkv projection, rotated in place (HF's rotate_half convention). torch runs the first as
// five elementwise ops and the second as seven, each its own pass and its own OpenMP region;
// on a loaded 2-core machine every region waits for a descheduled thread. Rows are shared
// out on the kernels' threads (spin_pool.h); decode-sized inputs (few rows) run on the
// calling thread alone. Called through kvfence.model.rows_cpu.
#include <cmath>
#include <cstdint>

#include "spin_pool.h"

namespace {
constexpr int64_t kParallelRows = 64;  // below: one thread (waking the others costs more)

// f(t) for every row t in [0, T), on `threads` threads when there are enough rows.
template <class F>
void each_row(int64_t T, int threads, F&& f) {
  kvf::parallel_parts(T >= kParallelRows ? threads : 1, [&](int part, int parts) {
    int64_t lo = 0, hi = 0;
    kvf::share(T, part, parts, &lo, &hi);
    for (int64_t t = lo; t < hi; ++t) f(t);
  });
}
}  // namespace

extern "C" void kvf_rms_norm(const float* x, const float* w, float* out, int64_t T, int64_t H,
                             float eps, int threads) {
  each_row(T, threads, [&](int64_t t) {
    const float* xt = x + t * H;
    float* ot = out + t * H;
    float ss = 0.0f;
    for (int64_t k = 0; k < H; ++k) ss += xt[k] * xt[k];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t k = 0; k < H; ++k) ot[k] = w[k] * (xt[k] * r);
  });
}

// x: T rows of `stride` floats; heads 0..H-1 of D floats each at the row's start are rotated.
// cos, sin: [T, D/2].
extern "C" void kvf_rope(float* x, int64_t T, int64_t stride, int64_t H, int64_t D,
                         const float* cos, const float* sin, int threads) {
  const int64_t half = D / 2;
  each_row(T, threads, [&](int64_t t) {
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
  });
}
