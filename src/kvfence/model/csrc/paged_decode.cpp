// Paged decode attention on the CPU: one query token per row, K/V read in place
// from the pool's pages through the row's page table (no gathered copy).
//
// Built by `python -m kvfence.model.paged_cpu build` (make install) and called
// through ctypes from kvfence.model.paged_cpu. The caller has already verified
// every page table against the ledger (I1, attention.begin_step); this kernel
// reads only the table entries covering [lo, hi) and refuses (returns 1) any
// entry outside the pool rather than reading out of bounds: an entry is checked
// before any byte of its page is read.
//
// A job is one row's query heads of one KV head (a GQA group reads each key
// once); jobs are taken one by one, since rows' contexts differ in length. Head
// dims 16/32/64/128 with groups of up to 8 take the vector path: the group's
// queries and outputs stay in registers, keys and values are read as whole
// vectors, the next page is prefetched into L2 (a row's pages lie anywhere in the
// pool, so the hardware prefetcher cannot guess them) key by key: each key fetches
// its place on the next page, which beat a whole page's lines at once by 1.6x
// (bench/decode_attention.py, 16 rows), and the softmax's exp is a
// polynomial the compiler vectorises. Other shapes take the scalar path.
//
// A few long rows make few jobs (one row of SmolLM2 is 3, one per KV head, on 2
// threads: one thread does two while the other waits), so when the jobs are fewer
// than kJobsPerThread per thread, each is cut into spans of keys of at least
// kMinSpan: every span is a job with its own softmax, writing its normalised
// output, maximum and sum, and the caller merges a row's spans by their weights
// (sum * exp(max - the row's maximum)) once every job is done.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "spin_pool.h"
#include "vec.h"

namespace {

using kvf::exp_nonpositive;
using kvf::hsum;
using kvf::kLanes;
using kvf::load;
using kvf::store;
using kvf::vf;

// Where one job reads: row r's table, its KV head, its key range [a, b).
struct Job {
  const float* q;  // [G, D]: the group's queries
  float* o;        // [G, D]
  const int64_t* table;
  int64_t a, b, kh;
  float* ms = nullptr;  // a span's job: [2, G], each query's maximum score, then its sum
};

constexpr int64_t kJobsPerThread = 4;  // fewer (row, KV head) jobs than this: cut into spans
constexpr int64_t kMinSpan = 256;      // keys; a shorter span's merge costs more than it saves

struct Shape {
  const float* k;
  const float* v;
  int64_t KVH, D, G, ps, P;
  float scale;
};

inline const float* at(const float* base, const Shape& s, int64_t page, int64_t pos, int64_t kh) {
  return base + ((page * s.ps + pos % s.ps) * s.KVH + kh) * s.D;
}

// The vector path for head dim D and group G; false if a table entry lies outside the pool.
template <int D, int G>
bool attend_vec(const Job& job, const Shape& s, std::vector<float>& scores) {
  constexpr int C = D / kLanes;
  const int64_t a = job.a, b = job.b, n = b - a, step = s.KVH * D;
  scores.resize(G * n);
  float* sc = scores.data();
  vf qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load(job.q + g * D + c * kLanes) * s.scale;
  float mx[G];
  std::fill(mx, mx + G, -std::numeric_limits<float>::infinity());
  for (int64_t pos = a; pos < b;) {  // scores, page by page
    const int64_t page = job.table[pos / s.ps];
    if (page < 0 || page >= s.P) return false;
    const int64_t end = std::min(b, (pos / s.ps + 1) * s.ps);
    const float* nk = nullptr;
    if (end < b) {
      const int64_t next = job.table[end / s.ps];
      if (next >= 0 && next < s.P) nk = at(s.k, s, next, pos, job.kh);
    }
    for (const float* kp = at(s.k, s, page, pos, job.kh); pos < end; ++pos, kp += step) {
      if (nk) {
        for (int c = 0; c < C; ++c) __builtin_prefetch(nk + c * kLanes, 0, 1);
        nk += step;
      }
      vf kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load(kp + c * kLanes);
      for (int g = 0; g < G; ++g) {
        vf acc = qv[g][0] * kv[0];
        for (int c = 1; c < C; ++c) acc += qv[g][c] * kv[c];
        const float x = hsum(acc);
        sc[g * n + (pos - a)] = x;
        mx[g] = x > mx[g] ? x : mx[g];
      }
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {  // every table entry was in the pool: softmax, then values
    float* sg = sc + g * n;
    const float m = mx[g];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = exp_nonpositive(sg[j] - m);
      sum += sg[j];
    }
    inv[g] = 1.0f / sum;
    if (job.ms) job.ms[g] = m, job.ms[G + g] = sum;
  }
  vf ov[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) ov[g][c] = vf{};
  for (int64_t pos = a; pos < b;) {
    const int64_t page = job.table[pos / s.ps];
    const int64_t end = std::min(b, (pos / s.ps + 1) * s.ps);
    const float* nv = end < b ? at(s.v, s, job.table[end / s.ps], pos, job.kh) : nullptr;
    for (const float* vp = at(s.v, s, page, pos, job.kh); pos < end; ++pos, vp += step) {
      if (nv) {
        for (int c = 0; c < C; ++c) __builtin_prefetch(nv + c * kLanes, 0, 1);
        nv += step;
      }
      vf vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load(vp + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const float p = sc[g * n + (pos - a)];
        for (int c = 0; c < C; ++c) ov[g][c] += p * vv[c];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store(job.o + g * D + c * kLanes, ov[g][c] * inv[g]);
  return true;
}

// Any head dim and group: the same computation, scalar.
bool attend_scalar(const Job& job, const Shape& s, std::vector<float>& scores) {
  const int64_t a = job.a, b = job.b, n = b - a, G = s.G, D = s.D;
  scores.resize(G * n);
  std::vector<float> mx(G, -std::numeric_limits<float>::infinity()), sum(G, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t page = job.table[(a + j) / s.ps];
    if (page < 0 || page >= s.P) return false;
    const float* kk = at(s.k, s, page, a + j, job.kh);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = job.q + g * D;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * kk[d];
      acc *= s.scale;
      scores[g * n + j] = acc;
      mx[g] = std::max(mx[g], acc);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < n; ++j) {
      scores[g * n + j] = std::exp(scores[g * n + j] - mx[g]);
      sum[g] += scores[g * n + j];
    }
  }
  for (int64_t g = 0; job.ms && g < G; ++g) job.ms[g] = mx[g], job.ms[G + g] = sum[g];
  std::fill(job.o, job.o + G * D, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* vv = at(s.v, s, job.table[(a + j) / s.ps], a + j, job.kh);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + j] / sum[g];
      float* og = job.o + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * vv[d];
    }
  }
  return true;
}

using AttendFn = bool (*)(const Job&, const Shape&, std::vector<float>&);

template <int D>
AttendFn for_group(int64_t G) {
  switch (G) {
    case 1: return attend_vec<D, 1>;
    case 2: return attend_vec<D, 2>;
    case 3: return attend_vec<D, 3>;
    case 4: return attend_vec<D, 4>;
    case 5: return attend_vec<D, 5>;
    case 6: return attend_vec<D, 6>;
    case 7: return attend_vec<D, 7>;
    case 8: return attend_vec<D, 8>;
    default: return attend_scalar;
  }
}

AttendFn for_shape(int64_t D, int64_t G) {
  switch (D) {
    case 16: return for_group<16>(G);
    case 32: return for_group<32>(G);
    case 64: return for_group<64>(G);
    case 128: return for_group<128>(G);
    default: return attend_scalar;
  }
}

}  // namespace

// vector: 0 forces the scalar path (the tests compare the two).
extern "C" int kvf_paged_decode(
    const float* q,          // [R, H, D]
    const float* k,          // [P, ps, KVH, D]: one layer of the pool
    const float* v,          // [P, ps, KVH, D]
    const int64_t* table,    // [R, W] page indices
    const int64_t* lo,       // [R] first key position attended
    const int64_t* hi,       // [R] one past the last key position attended
    float* out,              // [R, H, D]
    int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t ps, int64_t W, int64_t P,
    float scale, int threads, int vector) {
  const Shape shape{k, v, KVH, D, H / KVH, ps, P, scale};
  const AttendFn attend = vector ? for_shape(D, shape.G) : attend_scalar;
  const int64_t G = shape.G, jobs = R * KVH;
  // Spans per (row, KV head) job: kJobsPerThread or more jobs for each thread, the same number
// for each (equal spans of one row take equal time), none shorter than kMinSpan.
  int64_t spans = 1;
  if (threads > 1 && jobs < kJobsPerThread * threads) {
    int64_t longest = 0;
    for (int64_t r = 0; r < R; ++r) longest = std::max(longest, std::min(hi[r], W * ps) - lo[r]);
    spans = (kJobsPerThread * threads + jobs - 1) / jobs;
    while (jobs * spans % threads != 0) ++spans;  // as many jobs for each thread
    spans = std::max<int64_t>(1, std::min(spans, longest / kMinSpan));
  }
  // A span's output [G, D] and its [2, G] maxima and sums, per (row, KV head, span).
  std::vector<float> part(spans > 1 ? jobs * spans * G * (D + 2) : 0);
  std::atomic<int> bad{0};
  std::atomic<int64_t> next{0};
  kvf::parallel_parts(threads, [&](int, int) {
    std::vector<float> scores;
    for (int64_t j; (j = next.fetch_add(1)) < jobs * spans;) {
      const int64_t r = j / spans / KVH, kh = j / spans % KVH, sp = j % spans;
      const int64_t a = lo[r], b = std::min(hi[r], W * ps);
      Job job{q + (r * H + kh * G) * D, out + (r * H + kh * G) * D, table + r * W, a, b, kh};
      if (spans > 1) {  // keys [a, b) cut evenly; a row shorter than `spans` keys has empty ones
        job.a = a + (b - a) * sp / spans;
        job.b = a + (b - a) * (sp + 1) / spans;
        job.o = part.data() + j * G * (D + 2);
        job.ms = job.o + G * D;
      }
      if (job.b <= job.a) {
        std::fill(job.o, job.o + G * D, 0.0f);
        if (job.ms) std::fill(job.ms, job.ms + 2 * G, 0.0f);  // weight 0 in the merge
      } else if (!attend(job, shape, scores)) {
        bad.store(1);  // the call fails; the caller raises and uses no output
      }
    }
  });
  if (spans == 1 || bad.load()) return bad.load();
  for (int64_t j = 0; j < jobs; ++j) {  // merge each (row, KV head)'s spans into `out`
    const int64_t r = j / KVH, kh = j % KVH;
    const float* first = part.data() + j * spans * G * (D + 2);
    for (int64_t g = 0; g < G; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < spans; ++sp) {
        const float* ms = first + sp * G * (D + 2) + G * D;
        if (ms[G + g] > 0.0f) top = std::max(top, ms[g]);
      }
      float* o = out + (r * H + kh * G + g) * D;
      std::fill(o, o + D, 0.0f);
      float total = 0.0f;
      for (int64_t sp = 0; sp < spans; ++sp) {
        const float* po = first + sp * G * (D + 2);
        const float* ms = po + G * D;
        if (!(ms[G + g] > 0.0f)) continue;  // an empty span
        const float w = ms[G + g] * exp_nonpositive(ms[g] - top);
        total += w;
        for (int64_t d = 0; d < D; ++d) o[d] += w * po[g * D + d];
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return 0;
}
