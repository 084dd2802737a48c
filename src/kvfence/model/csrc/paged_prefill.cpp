// Paged prefill attention on the CPU: a chunk of query tokens per row, causal over the
// row's own K/V, read in place from the pool's pages through the row's page table.
//
// Built with the decode kernel (paged_decode.cpp) and called through ctypes from
// kvfence.model.paged_cpu. The caller has verified every page table against the
// ledger (I1, attention.begin_step) before the step. This kernel reads only a row's
// keys [0, hi), hi = min(its last token's position + 1, its length), looking each
// one up in the row's table, and refuses (returns 1) an entry outside the pool
// before it reads a byte of that page. A key past a query's position (or before its
// window) gets a weight of exactly 0, never a tiny one: the row's own later tokens
// must not reach its earlier ones, and no slot at or past hi is read at all (a
// page's tail may hold what an earlier owner wrote).
//
// Flash attention in two passes per call. Pass 1 lays each row's keys out per KV
// head in tiles of 16 (whatever the page size), transposed to [D][16], and notes
// where each key's value lies; it is the only pass that reads the table. Pass 2 runs
// one job per (row, KV head, block of 16 query tokens, 64 in a row of 2,048 keys or
// more): the block's tokens times the KV head's query group are its query vectors,
// and a score tile of 8 of them is D fused multiply-adds of a broadcast query element
// by a vector of 16 keys. Keys are taken in spans of four tiles where four remain (64
// keys: one maximum, one rescale of the outputs and one pass of the values per span),
// else two, else one; scores are computed two tiles at a time (two independent
// accumulators per query vector; four would not fit the registers). The softmax is
// online (a running maximum and sum per query vector), each weight 2^((s - m) log2 e)
// (exp2_vec below); only spans that cross a query's position pay for a mask.
// A span's softmax takes three passes over its 8 query vectors (the maxima, the
// exps, the rescales), so each pass's work is independent from vector to vector.
// Jobs are taken longest first (the blocks at the end of a prompt attend the most
// keys) on the spin pool's threads: a chunk of 512 tokens is 24 jobs or more with
// SmolLM2's 3 KV heads, so two threads finish within one job of each other.
// bench/prefill.py measures it against torch's SDPA over the gathered pages,
// bench/long_prompts.py at 2k-8k tokens against the peers.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "spin_pool.h"
#include "vec.h"

namespace {

using kvf::kLanes;
using kvf::load;
using kvf::store;
using kvf::vf;

typedef int32_t vi __attribute__((vector_size(kLanes * 4)));

constexpr int64_t kBlock = 16;  // query tokens per job
// A row attending at least kLongKeys keys takes kLongBlock tokens per job instead: its K/V
// per KV head (2 MiB at 4,096 keys of dim 64) no longer stay in a core's L2 between jobs,
// and each job streams them once, so a longer block streams them fewer times per query.
// A short row keeps short blocks, which give both threads enough jobs.
constexpr int64_t kLongKeys = 2048;
constexpr int64_t kLongBlock = 64;
constexpr float kLog2e = 1.44269504088896341f;
constexpr int kRows = 8;         // query vectors per score tile (independent FMA chains)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf splat(float x) { return vf{} + x; }

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// The largest lane, by halves in registers (a round trip through the stack, as a
// memcpy of the halves compiles to here, stalls on store forwarding every tile).
inline float hmax(vf v) {
  const kvf::vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const kvf::vf8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const kvf::vf8 c = a > b ? a : b;
  const kvf::vf4 x = __builtin_shufflevector(c, c, 0, 1, 2, 3);
  const kvf::vf4 y = __builtin_shufflevector(c, c, 4, 5, 6, 7);
  const kvf::vf4 z = x > y ? x : y;
  const float u = z[0] > z[2] ? z[0] : z[2], w = z[1] > z[3] ? z[1] : z[3];
  return u > w ? u : w;
}

inline float hsum(vf v) {
  const kvf::vf8 c = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const kvf::vf4 z = __builtin_shufflevector(c, c, 0, 1, 2, 3) +
                     __builtin_shufflevector(c, c, 4, 5, 6, 7);
  return (z[0] + z[2]) + (z[1] + z[3]);
}

// 2^x of each lane, every lane <= 0: n = round(x), r = x - n in [-1/2, 1/2] (exact), and
// Cephes' exp2f polynomial for 2^r; no two-part reduction by ln 2 as exp needs. The caller
// passes (s - m) * log2(e): the difference first, so the rounding of the product is
// relative to it, not to the score (scaling the queries by log2(e) instead made the
// weights of a sharp softmax five times less exact; tests/model, sharp scores). With
// AVX-512 the rounding and the 2^n scale are one instruction each (roundscale, scalef).
inline vf exp2_poly(vf r) {
  vf p = splat(1.535336188319500e-4f);
  p = p * r + 1.339887440266574e-3f;
  p = p * r + 9.618437357674640e-3f;
  p = p * r + 5.550332471162809e-2f;
  p = p * r + 2.402264791363012e-1f;
  p = p * r + 6.931472028550421e-1f;
  return p * r + 1.0f;
}

inline vf exp2_vec(vf x) {
  x = vmax(x, splat(-126.0f));
#if defined(__AVX512F__)
  if (kLanes == 16) {
    const vf n = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (vf)_mm512_scalef_ps((__m512)exp2_poly(x - n), (__m512)n);
  }
#endif
  const vf y = x + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf);  // toward zero
  n = n > y ? n - 1.0f : n;                                            // floor(x + 1/2)
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n, n in [-126, 0]
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp2_poly(x - n) * scale;
}

// One prefill row as both passes see it.
struct Row {
  const int64_t* table;
  int64_t start, end, hi;  // tokens [start, end); keys [0, hi)
  int64_t tiles;           // ceil(hi / 16)
  float* kt;               // [KVH, tiles, D, 16]: keys, transposed
  int64_t* voff;           // [tiles * 16]: where key j's value lies in a layer (head 0)
};

struct Layout {
  const float* q;  // [T, H, D], token rows q_stride floats apart
  const float* k;  // [P, ps, KVH, D]: one layer of the pool
  const float* v;
  float* out;      // [T, H, D]
  const int64_t* positions;  // [T]
  int64_t H, KVH, D, G, ps, P, window, q_stride;
  float scale;
};

// Pass 1, one (row, tile): transpose the tile's keys for every KV head; false on a bad entry.
bool lay_out_tile(const Row& row, int64_t tile, const Layout& s) {
  const int64_t D = s.D, k0 = tile * kLanes, n = std::min<int64_t>(kLanes, row.hi - k0);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t kp = k0 + j;
    const int64_t page = row.table[kp / s.ps];
    if (page < 0 || page >= s.P) return false;
    row.voff[kp] = (page * s.ps + kp % s.ps) * s.KVH * D;
  }
  for (int64_t kh = 0; kh < s.KVH; ++kh) {
    float* kt = row.kt + (kh * row.tiles + tile) * D * kLanes;
    for (int64_t j = 0; j < n; ++j) {
      const float* kk = s.k + row.voff[k0 + j] + kh * D;
      for (int64_t d = 0; d < D; ++d) kt[d * kLanes + j] = kk[d];
    }
    for (int64_t j = n; j < kLanes; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * kLanes + j] = 0.0f;
  }
  return true;
}

struct Job {
  const Row* row;
  int64_t t0, t1, kh;
};

// Scores of kRows query vectors (rows of q, D apart) against NT adjacent transposed tiles
// (16 * NT keys; tile t's scores at out[t * kRows + i]). Not inlined: in the caller's
// frame GCC kept one accumulator on the stack, a store and a reload in every step of the
// chain (perf annotate: 40% of the kernel's time).
template <int D, int NT>
__attribute__((noinline)) void score_tiles(const float* q, const float* kt, vf* out) {
  static_assert(kRows == 8, "one accumulator per query vector and tile");
  vf s[NT][kRows];
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < kRows; ++i) s[t][i] = vf{};
  for (int d = 0; d < D; ++d) {
    vf kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = load(kt + t * D * kLanes + d * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const float qi = q[i * D + d];
      for (int t = 0; t < NT; ++t) s[t][i] += qi * kv[t];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < kRows; ++i) out[t * kRows + i] = s[t][i];
}

// The bounds and buffers of one job, as the spans below see them.
struct Block {
  const float* qs;     // [Rp, D] scaled queries
  float* acc;          // [Rp, D] running outputs
  float* sum;          // [Rp, 16] running sums, lane by lane
  float* mx;           // [Rp] running maxima
  const int64_t* first;
  const int64_t* last;
  int64_t Rp;
};

// One span of NT tiles (keys [k0, k0 + n), n <= 16 * NT) against every query vector of
// the block: scores, the online softmax's update, then the values. The softmax's
// per-span work (the maximum, the rescale of the outputs) is paid once per NT tiles.
template <int C, int NT>
void attend_span(const Block& b, const float* kt, const float* const* vrow, int64_t k0,
                 int64_t n) {
  constexpr int D = C * kLanes, S = NT * kLanes;
  vi lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  alignas(64) float pbuf[kRows][S];
  for (int64_t r0 = 0; r0 < b.Rp; r0 += kRows) {
    bool any = false, whole = n == S;
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = r0 + i;
      any |= b.last[r] >= k0 && b.first[r] < k0 + n;
      whole &= b.first[r] <= k0 && b.last[r] >= k0 + S - 1;
    }
    if (!any) continue;
    vf sc[NT * kRows];
    if constexpr (NT == 4) {  // two calls of two tiles: 8 x 4 accumulators would spill
      score_tiles<D, 2>(b.qs + r0 * D, kt, sc);
      score_tiles<D, 2>(b.qs + r0 * D, kt + 2 * D * kLanes, sc + 2 * kRows);
    } else {
      score_tiles<D, NT>(b.qs + r0 * D, kt, sc);
    }
    // The softmax in three passes over the block's rows, so no row's exps wait on the
    // horizontal maximum and scalar work before them: each pass's rows are independent.
    float m_new[kRows];
    vi live[NT * kRows];  // whole spans leave it unread
    for (int i = 0; i < kRows; ++i) {  // each row's new maximum (masked keys at -inf)
      const int64_t r = r0 + i;
      vf m = splat(kNegInf);
      for (int t = 0; t < NT; ++t) {
        vf& x = sc[t * kRows + i];
        if (!whole) {  // lane j of tile t attends iff first[r] <= k0 + 16 t + j <= last[r]
          const vi kp = lane + static_cast<int32_t>(k0 + t * kLanes);
          vi& l = live[t * kRows + i];
          l = (kp >= static_cast<int32_t>(b.first[r])) & (kp <= static_cast<int32_t>(b.last[r]));
          x = l ? x : splat(kNegInf);
        }
        m = vmax(m, x);
      }
      const float span_max = hmax(m);
      m_new[i] = span_max > b.mx[r] ? span_max : b.mx[r];
    }
    vf total[kRows];
    for (int i = 0; i < kRows; ++i) {  // the weights: exp(score - new maximum), 0 if masked
      const vf mv = splat(m_new[i] == kNegInf ? 0.0f : m_new[i]);
      vf sum_i{};
      for (int t = 0; t < NT; ++t) {
        vf p = exp2_vec((sc[t * kRows + i] - mv) * kLog2e);
        if (!whole) p = live[t * kRows + i] ? p : vf{};  // exactly 0, not exp(-87)
        store(pbuf[i] + t * kLanes, p);
        sum_i += p;
      }
      total[i] = sum_i;
    }
    for (int i = 0; i < kRows; ++i) {  // rescale what the row has so far to the new maximum
      const int64_t r = r0 + i;
      if (m_new[i] == kNegInf) continue;  // nothing attended yet, nor in this span
      const float alpha = b.mx[r] == kNegInf ? 0.0f : std::exp2((b.mx[r] - m_new[i]) * kLog2e);
      store(b.sum + r * kLanes, load(b.sum + r * kLanes) * alpha + total[i]);
      b.mx[r] = m_new[i];
      if (alpha != 1.0f) {
        float* a = b.acc + r * D;
        for (int c = 0; c < C; ++c) store(a + c * kLanes, load(a + c * kLanes) * alpha);
      }
    }
    for (int h = 0; h < kRows; h += 4) {  // values, 4 query vectors at a time
      vf o[4][C];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) o[i][c] = load(b.acc + (r0 + h + i) * D + c * kLanes);
      for (int64_t j = 0; j < n; ++j) {
        vf vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load(vrow[j] + c * kLanes);
        for (int i = 0; i < 4; ++i) {
          const float w = pbuf[h + i][j];
          for (int c = 0; c < C; ++c) o[i][c] += w * vv[c];
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) store(b.acc + (r0 + h + i) * D + c * kLanes, o[i][c]);
    }
  }
}

// Pass 2, one job. Its query vectors are r = token * G + g.
template <int C>
void attend_block(const Job& job, const Layout& s, std::vector<float>& scratch,
                  std::vector<int64_t>& bounds) {
  constexpr int D = C * kLanes;
  const Row& row = *job.row;
  const int64_t G = s.G, nt = job.t1 - job.t0, R = nt * G;
  const int64_t Rp = (R + kRows - 1) / kRows * kRows;  // padded to whole score tiles
  scratch.resize(2 * Rp * D + Rp * (kLanes + 1));
  float* qs = scratch.data();  // [Rp, D], scaled
  float* acc = qs + Rp * D;    // [Rp, D]
  float* sum = acc + Rp * D;   // [Rp, 16]: running sums, lane by lane (one hsum at the end)
  float* mx = sum + Rp * kLanes;  // [Rp]
  bounds.resize(2 * Rp);
  int64_t* first = bounds.data();  // [Rp] first key each query attends
  int64_t* last = first + Rp;      // [Rp] last key (its position, capped below hi)
  int64_t lo = row.hi;
  for (int64_t r = 0; r < Rp; ++r) {
    const int64_t t = std::min(r, R - 1) / G, g = std::min(r, R - 1) % G;
    const int64_t p = s.positions[job.t0 + t];
    first[r] = s.window > 0 ? std::max<int64_t>(0, p - s.window + 1) : 0;
    last[r] = r < R ? std::min(p, row.hi - 1) : -1;  // padding rows attend nothing
    if (r < R) lo = std::min(lo, first[r]);
    const float* src = s.q + (job.t0 + t) * s.q_stride + (job.kh * G + g) * D;
    for (int d = 0; d < D; ++d) qs[r * D + d] = src[d] * s.scale;
  }
  int64_t hi = 0;
  for (int64_t r = 0; r < R; ++r) hi = std::max(hi, last[r] + 1);
  std::fill(acc, acc + Rp * D, 0.0f);
  std::fill(mx, mx + Rp, kNegInf);
  std::fill(sum, sum + Rp * kLanes, 0.0f);
  const Block b{qs, acc, sum, mx, first, last, Rp};
  const float* kts = row.kt + job.kh * row.tiles * D * kLanes;
  const float* vrow[4 * kLanes];
  // Spans of four tiles where more than three remain below hi, else of two, else one.
  for (int64_t tile = lo / kLanes; tile * kLanes < hi;) {
    const int64_t k0 = tile * kLanes, n = std::min<int64_t>(4 * kLanes, hi - k0);
    for (int64_t j = 0; j < n; ++j) vrow[j] = s.v + row.voff[k0 + j] + job.kh * D;
    const float* kt = kts + tile * D * kLanes;
    if (n > 3 * kLanes) {
      attend_span<C, 4>(b, kt, vrow, k0, n);
      tile += 4;
    } else if (n > kLanes) {
      attend_span<C, 2>(b, kt, vrow, k0, std::min<int64_t>(n, 2 * kLanes));
      tile += 2;
    } else {
      attend_span<C, 1>(b, kt, vrow, k0, n);
      tile += 1;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / G, g = r % G;
    float* dst = s.out + ((job.t0 + t) * s.H + job.kh * G + g) * D;
    const float total = hsum(load(sum + r * kLanes));
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

using BlockFn = void (*)(const Job&, const Layout&, std::vector<float>&, std::vector<int64_t>&);

BlockFn for_dim(int64_t D) {
  switch (D) {
    case 16: return attend_block<1>;
    case 32: return attend_block<2>;
    case 64: return attend_block<4>;
    case 128: return attend_block<8>;
    default: return nullptr;
  }
}

}  // namespace

// Returns 0; 1 if a table entry lies outside the pool (nothing is written then); 2 for a
// head dim without a kernel (16, 32, 64 and 128 have one): the caller gathers instead.
extern "C" int kvf_paged_prefill(
    const float* q,             // [T, H, D]: each token's heads contiguous, q_stride apart
    const float* k,             // [P, ps, KVH, D]
    const float* v,             // [P, ps, KVH, D]
    const int64_t* table,       // [B, W] page indices
    const int64_t* rows,        // [N] each prefill row's index in the table
    const int64_t* starts,      // [N] its first token in q
    const int64_t* ends,        // [N] one past its last token
    const int64_t* lengths,     // [N] keys it may attend: [0, length)
    const int64_t* positions,   // [T] each token's position in its row
    float* out,                 // [T, H, D]: written for the prefill rows' tokens only
    int64_t N, int64_t H, int64_t KVH, int64_t D, int64_t ps, int64_t W, int64_t P,
    int64_t window, int64_t q_stride, float scale, int threads) {
  const BlockFn attend = for_dim(D);
  if (attend == nullptr) return 2;
  const Layout layout{q, k, v, out, positions, H, KVH, D, H / KVH, ps, P, window, q_stride, scale};
  std::vector<Row> prefill(N);
  int64_t kt_size = 0, voff_size = 0;
  for (int64_t i = 0; i < N; ++i) {
    int64_t top = 0;
    for (int64_t t = starts[i]; t < ends[i]; ++t) top = std::max(top, positions[t] + 1);
    const int64_t hi = std::max<int64_t>(0, std::min({top, lengths[i], W * ps}));
    const int64_t tiles = (hi + kLanes - 1) / kLanes;
    prefill[i] = Row{table + rows[i] * W, starts[i], ends[i], hi, tiles, nullptr, nullptr};
    kt_size += KVH * tiles * D * kLanes;
    voff_size += tiles * kLanes;
  }
  // Left uninitialised (a serial memset of megabytes per call at long context): pass 1
  // writes every float of every tile, padding lanes included, and every key's offset below
  // hi, and pass 2 reads nothing else.
  const std::unique_ptr<float[]> kt(new float[kt_size]);
  const std::unique_ptr<int64_t[]> voff(new int64_t[voff_size]);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (row, tile)
  for (int64_t i = 0, a = 0, b = 0; i < N; ++i) {
    prefill[i].kt = kt.get() + a;
    prefill[i].voff = voff.get() + b;
    a += KVH * prefill[i].tiles * D * kLanes;
    b += prefill[i].tiles * kLanes;
    for (int64_t t = 0; t < prefill[i].tiles; ++t) tiles.emplace_back(i, t);
  }
  std::atomic<int> bad{0};
  std::atomic<int64_t> next{0};
  kvf::parallel_parts(threads, [&](int, int) {
    for (int64_t j; (j = next.fetch_add(1)) < static_cast<int64_t>(tiles.size());)
      if (!lay_out_tile(prefill[tiles[j].first], tiles[j].second, layout)) bad.store(1);
  });
  if (bad.load()) return 1;  // no query has read anything yet
  std::vector<Job> jobs;
  for (const Row& row : prefill)
    for (int64_t t0 = row.start, blk = row.hi >= kLongKeys ? kLongBlock : kBlock; t0 < row.end;
         t0 += blk)
      for (int64_t kh = 0; kh < KVH; ++kh)
        jobs.push_back(Job{&row, t0, std::min(row.end, t0 + blk), kh});
  // Longest first: a block's work grows with the position of its last token.
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job& a, const Job& b) {
    return positions[a.t1 - 1] > positions[b.t1 - 1];
  });
  next.store(0);
  kvf::parallel_parts(threads, [&](int, int) {
    std::vector<float> scratch;
    std::vector<int64_t> bounds;
    for (int64_t j; (j = next.fetch_add(1)) < static_cast<int64_t>(jobs.size());)
      attend(jobs[j], layout, scratch, bounds);
  });
  return 0;
}
