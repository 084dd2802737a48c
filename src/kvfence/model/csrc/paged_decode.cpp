// Paged decode attention on the CPU: one query token per row, K/V read in place
// from the pool's pages through the row's page table (no gathered copy).
//
// Built by `python -m kvfence.model.paged_cpu build` (make install) and called
// through ctypes from kvfence.model.paged_cpu. The caller has already verified
// every page table against the ledger (I1, attention.begin_step); this kernel
// reads only the table entries covering [lo, hi) and refuses (returns 1) any
// entry outside the pool rather than reading out of bounds.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "spin_pool.h"

extern "C" int kvf_paged_decode(
    const float* q,          // [R, H, D]
    const float* k,          // [P, ps, KVH, D]: one layer of the pool
    const float* v,          // [P, ps, KVH, D]
    const int64_t* table,    // [R, W] page indices
    const int64_t* lo,       // [R] first key position attended
    const int64_t* hi,       // [R] one past the last key position attended
    float* out,              // [R, H, D]
    int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t ps, int64_t W, int64_t P,
    float scale, int threads) {
  const int64_t G = H / KVH;
  std::atomic<int> bad{0};
  std::atomic<int64_t> next{0};  // jobs are taken one by one: rows' contexts differ in length
  auto one = [&](int64_t job) {
    const int64_t r = job / KVH, kh = job % KVH;
    const int64_t a = lo[r], b = hi[r] < W * ps ? hi[r] : W * ps;
    const float* qr = q + (r * H + kh * G) * D;
    float* o = out + (r * H + kh * G) * D;
    for (int64_t i = 0; i < G * D; ++i) o[i] = 0.0f;
    const int64_t n = b - a;
    if (n <= 0) return;
    std::vector<float> s(G * n);
    std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
    std::vector<const float*> rowp(n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = a + j;
      const int64_t page = table[r * W + pos / ps];
      if (page < 0 || page >= P) {
        bad.store(1);
        rowp[j] = nullptr;
        continue;
      }
      const int64_t off = ((page * ps + pos % ps) * KVH + kh) * D;
      rowp[j] = k + off;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qr + g * D;
        const float* kk = k + off;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qg[d] * kk[d];
        acc *= scale;
        s[g * n + j] = acc;
        if (acc > mx[g]) mx[g] = acc;
      }
    }
    if (bad.load()) return;  // the call fails; no row reads a null page
    std::vector<float> sum(G, 0.0f);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * n;
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = std::exp(sg[j] - mx[g]);
        sum[g] += sg[j];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* vv = v + (rowp[j] - k);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * n + j] / sum[g];
        float* og = o + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += p * vv[d];
      }
    }
  };
  kvf::parallel_parts(threads, [&](int, int) {
    for (int64_t job; (job = next.fetch_add(1)) < R * KVH;) one(job);
  });
  return bad.load();
}
