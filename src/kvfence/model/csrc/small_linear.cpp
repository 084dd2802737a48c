// out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for the few-token steps of decode,
// optionally with x first RMS-normalised and scaled by `norm` (HF's float32 RMSNorm)
// or x = silu(gate) * up of a fused gate/up output [M, 2K] (`glu`), and optionally
// with a residual [M, N] added to the result.
//
// At a handful of tokens a linear layer is bound by reading its weights once, so
// every weight byte is read once per step, on the decode kernels' threads
// (spin_pool.h), each thread taking its own blocks of weight rows. Two paths: the
// vector path (vtile: a block of rows against a few tokens in vector registers, the
// next block prefetched) for K a multiple of 16 (on AVX2 only for one token), and the
// scalar tile (four rows by four tokens, `omp simd`) for other K, or all K when `vector` is 0
// (bench, tests). On AVX-512 a token's outputs have the same bits whatever the step's
// other tokens, up to SMALL_TOKENS (kvfence.model.linear_cpu); on AVX2 from 2 tokens. Built
// with paged_decode.cpp into one library (kvfence.model.paged_cpu) and called through
// kvfence.model.linear_cpu; prefill-sized batches go to oneDNN.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "spin_pool.h"
#include "vec.h"

namespace {

// The scalar tile: rows n0..n0+3 of w against tokens m0..m0+MB-1 of x (1 <= MB <= 4).
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

// Rows n0..n0+R-1 of w against tokens m0..m0+T-1 of x, in registers, K a multiple of
// kvf::kLanes. `next` (or null) is the first row of the block the thread takes after this
// one: its every cache line is prefetched into L2 while this block computes (one line per
// row per kLanes floats). R weight rows read side by side defeat the hardware prefetcher:
// on the EPYC this was measured on, the tile read memory at 17-20 GB/s without this and
// 27-30 GB/s with it, as fast as torch.sum (bench/decode_linear.py).
template <int R, int T>
void vtile(const float* x, const float* w, const float* bias, const float* res, float* out,
           int64_t m0, int64_t n0, int64_t N, int64_t K, const float* next) {
  kvf::vf a[T][R] = {};
  const float* wr = w + n0 * K;
  const float* xm = x + m0 * K;
  for (int64_t k = 0; k < K; k += kvf::kLanes) {
    kvf::vf v[R];
    for (int r = 0; r < R; ++r) v[r] = kvf::load(wr + r * K + k);
    if (next) {
      for (int r = 0; r < R; ++r) __builtin_prefetch(next + r * K + k, 0, 1);
    }
    for (int t = 0; t < T; ++t) {
      const kvf::vf y = kvf::load(xm + t * K + k);
      for (int r = 0; r < R; ++r) a[t][r] += v[r] * y;
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      const int64_t o = (m0 + t) * N + n0 + r;
      out[o] = kvf::hsum(a[t][r]) + (bias ? bias[n0 + r] : 0.0f) + (res ? res[o] : 0.0f);
    }
  }
}

// The last rem < T tokens of a block in one pass (rem tokens in registers).
template <int R, int T>
void vrest(int64_t rem, const float* x, const float* w, const float* bias, const float* res,
           float* out, int64_t m, int64_t n0, int64_t N, int64_t K, const float* next) {
  if constexpr (T > 1) {
    if (rem == T - 1) {
      vtile<R, T - 1>(x, w, bias, res, out, m, n0, N, K, next);
    } else {
      vrest<R, T - 1>(rem, x, w, bias, res, out, m, n0, N, K, next);
    }
  }
}

// Blocks [b0, b1) of R weight rows against every token, T tokens at a time (the rest in
// one pass). The next block is prefetched during the first token group's pass over this one.
template <int R, int T>
void vblocks(const float* x, const float* w, const float* bias, const float* res, float* out,
             int64_t M, int64_t b0, int64_t b1, int64_t N, int64_t K) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    const int64_t n0 = nb * R;
    const float* next = nb + 1 < b1 ? w + (n0 + R) * K : nullptr;
    int64_t m = 0;
    for (; m + T <= M; m += T) vtile<R, T>(x, w, bias, res, out, m, n0, N, K, m ? nullptr : next);
    if (m < M) vrest<R, T>(M - m, x, w, bias, res, out, m, n0, N, K, m ? nullptr : next);
  }
}

// The vector path's blocks. AVX-512 (32 registers): 4 rows for one token (8 x 1 was 7%
// slower; one row at a time, a single sequential stream with no software prefetch, was
// 0.65-1.08x as fast in paired runs on an AMD EPYC (Zen 4), stop 30, worst on down, K =
// 1536, and while the host let memory stream fastest); 2-8 tokens: 3 rows x 8 tokens,
// every token in one pass over the block (28 registers: 24 sums, 3 weight vectors, a
// token's); more: 6 rows x 4 tokens (31: 24 sums, 6 weight vectors). Each pass after the
// first re-reads the block from cache and every sum costs a horizontal add at the end, so
// more tokens a pass pays. A decode step's linears (smollm, cold weights) at 5 / 8 / 12 /
// 16 tokens: 22.2 / 24.5 / 30.2 / 34.6 ms, against 25.3 / 27.0 / 31.9 / 37.1 for the 8
// rows x 2 tokens blocks before (stop 29, Xeon).
//
// AVX2 has 16 half-width registers: one token in blocks of 4 rows (1.04-1.17x the scalar
// tile; 2 rows: 0.82x), from two tokens the scalar tile (the vector path's 4 x 1 blocks ran
// 16 tokens at 0.3x its speed; 2 x 2 blocks: 0.77x at 2 tokens, 0.27x at 16, stop 30).
// Measured with -mno-avx512f on the AVX-512 machines. So on AVX2 a token alone gets other
// bits than beside others (the tile sums in another order); on AVX-512 every shape sums
// each output as the same chain. Taking the tile for one token too would give AVX2 that
// invariance for 5-13% of a one-token step's linears (stop 30); it is not taken, as no
// engine keeps it across the prefill-sized steps (oneDNN) that mix prompts with decode.
#ifdef __AVX512F__
constexpr int kOneRows = 4, kFewRows = 3, kFewTokens = 8, kRows = 6, kTokens = 4;
constexpr int64_t kVectorTokens = std::numeric_limits<int64_t>::max();
#else
constexpr int kOneRows = 4, kFewRows = 4, kFewTokens = 1, kRows = 4, kTokens = 1;
constexpr int64_t kVectorTokens = 1;
#endif

int64_t block_rows(int64_t M) {
  return M == 1 ? kOneRows : M <= kFewTokens ? kFewRows : kRows;
}

// This part's share of the blocks on the vector path.
void vector_rows(const float* x, const float* w, const float* bias, const float* res,
                 float* out, int64_t M, int part, int parts, int64_t N, int64_t K) {
  int64_t b0, b1;
  kvf::share(N / block_rows(M), part, parts, &b0, &b1);
  if (M == 1) {
    vblocks<kOneRows, 1>(x, w, bias, res, out, M, b0, b1, N, K);
  } else if (M <= kFewTokens) {
    vblocks<kFewRows, kFewTokens>(x, w, bias, res, out, M, b0, b1, N, K);
  } else {
    vblocks<kRows, kTokens>(x, w, bias, res, out, M, b0, b1, N, K);
  }
}

// The vector path's last N % R rows (fewer than a block), one at a time: each output the
// same chain of vector sums over K as a block's, so a token's outputs are bitwise the same
// whichever block shape its step takes (batch invariance; a scalar loop here gave, for N
// not a multiple of 3 or 6, those rows other bits at 2-16 tokens than alone).
void vector_rows_left(const float* x, const float* w, const float* bias, const float* res,
                      float* out, int64_t M, int64_t N, int64_t K) {
  vblocks<1, kFewTokens>(x, w, bias, res, out, M, N / block_rows(M) * block_rows(M), N, N, K);
}

// The scalar tile's last N % 4 rows (fewer than a tile), any K.
void rows_left(const float* x, const float* w, const float* bias, const float* res,
               float* out, int64_t M, int64_t n0, int64_t N, int64_t K) {
  for (int64_t n = n0; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float a = 0.0f;
      for (int64_t k = 0; k < K; ++k) a += w[n * K + k] * x[m * K + k];
      out[m * N + n] = a + (bias ? bias[n] : 0.0f) + (res ? res[m * N + n] : 0.0f);
    }
  }
}

// silu(g) * u for one token (x = gate then up, [2K]): sigmoid from exp(-|g|), which never
// overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below. Vectorised (omp simd).
void silu_times(const float* g, const float* u, float* out, int64_t K) {
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float e = kvf::exp_nonpositive(-std::fabs(g[k]));
    const float sig = (g[k] >= 0.0f ? 1.0f : e) / (1.0f + e);
    out[k] = g[k] * sig * u[k];
  }
}

}  // namespace

extern "C" void kvf_small_linear(const float* x, const float* w, const float* bias, float* out,
                                 int64_t M, int64_t N, int64_t K, int threads, const float* norm,
                                 float eps, int glu, const float* res, int vector) {
  std::vector<float> normed;
  if (glu || norm) {  // the tokens' prologue, split by tokens over the threads from 4 tokens
    normed.resize(M * K);
    kvf::parallel_parts(M >= 4 ? threads : 1, [&](int part, int parts) {
      int64_t first, last;
      kvf::share(M, part, parts, &first, &last);
      for (int64_t m = first; m < last; ++m) {
        if (glu) {
          silu_times(x + m * 2 * K, x + m * 2 * K + K, normed.data() + m * K, K);
        } else {
          kvf::rms_normed(x + m * K, norm, eps, normed.data() + m * K, K);
        }
      }
    });
    x = normed.data();
  }
  if (vector && K % kvf::kLanes == 0 && M <= kVectorTokens) {
    kvf::parallel_parts(threads, [&](int part, int parts) {
      vector_rows(x, w, bias, res, out, M, part, parts, N, K);
    });
    vector_rows_left(x, w, bias, res, out, M, N, K);
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
  rows_left(x, w, bias, res, out, M, blocks * 4, N, K);
}
