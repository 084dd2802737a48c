// The kernels' vector type: 16 floats, one AVX-512 register (two AVX2 ones where
// that is all the machine has), written with GCC's vector extension so that one
// source compiles to either with -march=native.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvf {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef float vf_unaligned __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }

inline float hsum(vf v) {
  vf8 a, b;
  std::memcpy(&a, &v, 32);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  const vf8 c = a + b;
  vf4 x, y;
  std::memcpy(&x, &c, 16);
  std::memcpy(&y, reinterpret_cast<const char*>(&c) + 16, 16);
  const vf4 z = x + y;
  return (z[0] + z[2]) + (z[1] + z[3]);
}

// exp(r) for r in [-ln 2 / 2, ln 2 / 2]: Cephes' expf polynomial.
inline float exp_poly(float r) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (a score minus its row's maximum, or -|x| in SiLU): Cephes' expf
// polynomial after range reduction by ln 2, within a few ulp of std::exp on [-87, 0];
// 2^-126 scale below.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  const float p = exp_poly(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// HF's float32 RMSNorm of one token: x * rsqrt(mean(x^2) + eps) * norm. The sum of squares
// is a vector reduction (omp simd): a serial one is one add latency per element.
inline void rms_normed(const float* x, const float* norm, float eps, float* out, int64_t K) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < K; ++k) ss += x[k] * x[k];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) out[k] = x[k] * r * norm[k];
}

}  // namespace kvf
