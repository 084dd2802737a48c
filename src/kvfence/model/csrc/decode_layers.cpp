// A decode step's decoder layers in one call from Python.
//
// Per layer this calls the same kernels, in the same order and on the same values,
// as kvfence.model.llama's per-layer path does one ctypes call at a time: RMSNorm
// fused into the qkv projection, RoPE on q and k, the new K/V written at the step's
// slots, paged decode attention, the o projection plus residual, RMSNorm fused into
// gate/up, SwiGLU fused into down plus residual. Its output is therefore bitwise the
// per-layer path's (tests/model/test_decode_layers.py). What it saves is the Python
// between the kernels: about 3 ms of a 25 ms one-token step on a 30-layer model.
//
// The caller has verified every page table against the ledger (I1,
// attention.begin_step) before this call; the attention kernel still refuses a table
// entry outside the pool, and every slot is checked against the pool before its
// K/V are written. On a refusal nothing after that layer runs and the caller raises.
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" void kvf_small_linear(const float* x, const float* w, const float* bias, float* out,
                                 int64_t M, int64_t N, int64_t K, int threads, const float* norm,
                                 float eps, int glu, const float* res, int vector);
extern "C" void kvf_rope(float* x, int64_t T, int64_t stride, int64_t H, int64_t D,
                         const float* cos, const float* sin);
extern "C" int kvf_paged_decode(const float* q, const float* k, const float* v,
                                const int64_t* table, const int64_t* lo, const int64_t* hi,
                                float* out, int64_t R, int64_t H, int64_t KVH, int64_t D,
                                int64_t ps, int64_t W, int64_t P, float scale, int threads,
                                int vector);

// One layer's parameters, in the order kvfence.model.decode_layers writes them;
// a bias the model does not have is null.
struct LayerWeights {
  const float* input_norm;
  const float* qkv_w;
  const float* qkv_b;
  const float* o_w;
  const float* o_b;
  const float* post_norm;
  const float* gate_up_w;
  const float* gate_up_b;
  const float* down_w;
  const float* down_b;
};

// The step's shapes and buffers (kvfence.model.decode_layers.Step mirrors it).
struct Step {
  int64_t tokens, layers, hidden, heads, kv_heads, head_dim, ff;
  int64_t page_size, pool_pages, table_width;
  float eps, scale;
  int threads, vector_linear, vector_attention;
  const LayerWeights* weights;  // [layers]
  const float* cos;             // [tokens, head_dim / 2]
  const float* sin;
  float* k_pool;                // [layers, pool_pages, page_size, kv_heads, head_dim]
  float* v_pool;
  const int64_t* slots;         // [tokens]: where each token's new K/V go
  const int64_t* table;         // [tokens, table_width]: each row's pages
  const int64_t* lo;            // [layers, tokens]: first key position each row attends
  const int64_t* hi;            // [layers, tokens]: one past the last
};

// 0: done, x holds the last layer's output. 1: a table entry outside the pool;
// 2: a slot outside the pool. Either way x is left unspecified.
extern "C" int kvf_decode_layers(const Step* s, float* x) {
  const int64_t T = s->tokens, D = s->head_dim;
  const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const int64_t layer_floats = s->pool_pages * s->page_size * kv_size;
  const int64_t slots_in_pool = s->pool_pages * s->page_size;
  for (int64_t t = 0; t < T; ++t) {
    if (s->slots[t] < 0 || s->slots[t] >= slots_in_pool) return 2;
  }
  std::vector<float> qkv(T * qkv_size), q(T * q_size), attn(T * q_size);
  std::vector<float> mid(T * s->hidden), gate_up(T * 2 * s->ff);
  const int th = s->threads;
  for (int64_t l = 0; l < s->layers; ++l) {
    const LayerWeights& w = s->weights[l];
    kvf_small_linear(x, w.qkv_w, w.qkv_b, qkv.data(), T, qkv_size, s->hidden, th,
                     w.input_norm, s->eps, 0, nullptr, s->vector_linear);
    kvf_rope(qkv.data(), T, qkv_size, s->heads + s->kv_heads, D, s->cos, s->sin);
    float* k_layer = s->k_pool + l * layer_floats;
    float* v_layer = s->v_pool + l * layer_floats;
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv.data() + t * qkv_size;
      std::memcpy(q.data() + t * q_size, row, q_size * sizeof(float));
      std::memcpy(k_layer + s->slots[t] * kv_size, row + q_size, kv_size * sizeof(float));
      std::memcpy(v_layer + s->slots[t] * kv_size, row + q_size + kv_size,
                  kv_size * sizeof(float));
    }
    if (kvf_paged_decode(q.data(), k_layer, v_layer, s->table, s->lo + l * T, s->hi + l * T,
                         attn.data(), T, s->heads, s->kv_heads, D, s->page_size,
                         s->table_width, s->pool_pages, s->scale, th, s->vector_attention)) {
      return 1;
    }
    kvf_small_linear(attn.data(), w.o_w, w.o_b, mid.data(), T, s->hidden, q_size, th, nullptr,
                     0.0f, 0, x, s->vector_linear);
    kvf_small_linear(mid.data(), w.gate_up_w, w.gate_up_b, gate_up.data(), T, 2 * s->ff,
                     s->hidden, th, w.post_norm, s->eps, 0, nullptr, s->vector_linear);
    kvf_small_linear(gate_up.data(), w.down_w, w.down_b, x, T, s->hidden, s->ff, th, nullptr,
                     0.0f, 1, mid.data(), s->vector_linear);
  }
  return 0;
}
