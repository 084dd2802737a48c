// out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for the few-token steps of decode,
// optionally with x first RMS-normalised and scaled by `norm` (HF's float32 RMSNorm)
// or x = silu(gate) * up of a fused gate/up output [M, 2K] (`glu`), and optionally
// with a residual [M, N] added to the result.
//
// At a handful of tokens a linear layer is bound by reading its weights once.
// Each thread streams its own block of weight rows, four at a time, against
// up to four tokens held in registers, so every weight byte is read once per
// step, on the decode kernels' threads (spin_pool.h). Built with paged_decode.cpp into one library (kvfence.model.paged_cpu)
// and called through kvfence.model.linear_cpu; prefill-sized batches stay on
// the BLAS path.
#include <cmath>
#include <cstdint>
#include <vector>

#include "spin_pool.h"
#include "vec.h"

namespace {

// Rows n0..n0+3 of w against tokens m0..m0+MB-1 of x (1 <= MB <= 4).
template <int MB>
void tile(const float* x, const float* w, const float* bias, const float* res, float* out,
          int64_t m0, int64_t n0, int64_t N, int64_t K) {
  const float* w0 = w + n0 * K;
  const float* w1 = w0 + K;
  const float* w2 = w1 + K;
  const float* w3 = w2 + K;
  const float* x0 = x + m0 * K;
  const float* x1 = MB > 1 ? x0 + K : x0;
  const float* x2 = MB > 2 ? x0 + 2 * K : x0;
  const float* x3 = MB > 3 ? x0 + 3 * K : x0;
  float a00 = 0, a01 = 0, a02 = 0, a03 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0;
  float a20 = 0, a21 = 0, a22 = 0, a23 = 0, a30 = 0, a31 = 0, a32 = 0, a33 = 0;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)
  for (int64_t k = 0; k < K; ++k) {
    const float v0 = w0[k], v1 = w1[k], v2 = w2[k], v3 = w3[k];
    const float y0 = x0[k];
    a00 += v0 * y0; a01 += v1 * y0; a02 += v2 * y0; a03 += v3 * y0;
    if (MB > 1) { const float y1 = x1[k]; a10 += v0 * y1; a11 += v1 * y1; a12 += v2 * y1; a13 += v3 * y1; }
    if (MB > 2) { const float y2 = x2[k]; a20 += v0 * y2; a21 += v1 * y2; a22 += v2 * y2; a23 += v3 * y2; }
    if (MB > 3) { const float y3 = x3[k]; a30 += v0 * y3; a31 += v1 * y3; a32 += v2 * y3; a33 += v3 * y3; }
  }
  const float acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                           {a30, a31, a32, a33}};
  for (int i = 0; i < MB; ++i) {
    float* o = out + (m0 + i) * N + n0;
    const float* r = res ? res + (m0 + i) * N + n0 : nullptr;
    for (int j = 0; j < 4; ++j) {
      o[j] = acc[i][j] + (bias ? bias[n0 + j] : 0.0f);
      if (r) o[j] += r[j];
    }
  }
}

// Up to this many floats of tokens (M * K), rows_streamed; above, the tile. rows_streamed
// reads the tokens once per weight row, so they must stay in L1 beside the streaming row:
// here it won at 1 x 576, 1 x 1536, 4 x 576 and lost at 2 x 1536 (12 KiB), 4 x 1536, 16 x 576.
constexpr int64_t kStreamedFloats = 2560;

// Weight row `wn` against tokens x[0..MB) (rows K apart): out_i = <x_i, wn>, for K a
// multiple of kvf::kLanes. The row is read once, front to back, and stays in L1 for the
// next group of tokens. One row at a time is the point: on the EPYC this was measured on,
// streaming two or four rows side by side (the tile above) read memory at 17-20 GB/s,
// one row after another at 29-30 GB/s (bench/decode_linear.py).
template <int MB>
inline void row_dot(const float* x, const float* wn, int64_t K, float* acc) {
  kvf::vf a[MB] = {}, b[MB] = {};
  int64_t k = 0;
  for (; k + 2 * kvf::kLanes <= K; k += 2 * kvf::kLanes) {
    const kvf::vf v = kvf::load(wn + k), u = kvf::load(wn + k + kvf::kLanes);
    for (int i = 0; i < MB; ++i) {
      a[i] += v * kvf::load(x + i * K + k);
      b[i] += u * kvf::load(x + i * K + k + kvf::kLanes);
    }
  }
  if (k < K) {
    const kvf::vf v = kvf::load(wn + k);
    for (int i = 0; i < MB; ++i) a[i] += v * kvf::load(x + i * K + k);
  }
  for (int i = 0; i < MB; ++i) acc[i] = kvf::hsum(a[i] + b[i]);
}

// Rows [n0, n1) of w against every token, one row at a time (row_dot).
void rows_streamed(const float* x, const float* w, const float* bias, const float* res,
                   float* out, int64_t M, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  float acc[4];
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m = 0; m < M; m += 4) {
      const int mb = M - m < 4 ? static_cast<int>(M - m) : 4;
      const float* xm = x + m * K;
      switch (mb) {
        case 4: row_dot<4>(xm, wn, K, acc); break;
        case 3: row_dot<3>(xm, wn, K, acc); break;
        case 2: row_dot<2>(xm, wn, K, acc); break;
        default: row_dot<1>(xm, wn, K, acc); break;
      }
      for (int i = 0; i < mb; ++i) {
        const int64_t o = (m + i) * N + n;
        out[o] = acc[i] + b + (res ? res[o] : 0.0f);
      }
    }
  }
}

}  // namespace

extern "C" void kvf_small_linear(const float* x, const float* w, const float* bias, float* out,
                                 int64_t M, int64_t N, int64_t K, int threads, const float* norm,
                                 float eps, int glu, const float* res) {
  std::vector<float> normed;
  if (glu) {  // x is [M, 2K]: gate then up
    normed.resize(M * K);
    for (int64_t m = 0; m < M; ++m) {
      const float* g = x + m * 2 * K;
      const float* u = g + K;
      for (int64_t k = 0; k < K; ++k) normed[m * K + k] = g[k] / (1.0f + std::exp(-g[k])) * u[k];
    }
    x = normed.data();
  } else if (norm) {  // x[m] * rsqrt(mean(x[m]^2) + eps) * norm, once per token before the weights
    normed.resize(M * K);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float ss = 0.0f;
      for (int64_t k = 0; k < K; ++k) ss += xm[k] * xm[k];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
      for (int64_t k = 0; k < K; ++k) normed[m * K + k] = xm[k] * r * norm[k];
    }
    x = normed.data();
  }
  if (K % kvf::kLanes == 0 && M * K <= kStreamedFloats) {
    kvf::parallel_parts(threads, [&](int part, int parts) {
      int64_t first, last;
      kvf::share(N, part, parts, &first, &last);
      rows_streamed(x, w, bias, res, out, M, first, last, N, K);
    });
    return;
  }
  const int64_t blocks = N / 4;
  kvf::parallel_parts(threads, [&](int part, int parts) {
    int64_t first, last;
    kvf::share(blocks, part, parts, &first, &last);
    for (int64_t nb = first; nb < last; ++nb) {
      const int64_t n0 = nb * 4;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4>(x, w, bias, res, out, m, n0, N, K);
      switch (M - m) {
        case 3: tile<3>(x, w, bias, res, out, m, n0, N, K); break;
        case 2: tile<2>(x, w, bias, res, out, m, n0, N, K); break;
        case 1: tile<1>(x, w, bias, res, out, m, n0, N, K); break;
        default: break;
      }
    }
  });
  for (int64_t n = blocks * 4; n < N; ++n) {  // the last N % 4 weight rows
    for (int64_t m = 0; m < M; ++m) {
      float a = 0.0f;
      for (int64_t k = 0; k < K; ++k) a += w[n * K + k] * x[m * K + k];
      out[m * N + n] = a + (bias ? bias[n] : 0.0f) + (res ? res[m * N + n] : 0.0f);
    }
  }
}
