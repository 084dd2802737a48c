// I1's per-step checks in one call (kvfence.model.step_checks).
//
// Before a model step writes or reads any K/V, three things happen in this order
// (attention.begin_step): every new token's slot is the one its row's page table
// names for its position (the write check); the pages written are marked written,
// extending each page's written prefix only across no hole; and every page each row
// reads is, now, owned by the row or its namespace, at the generation the row
// recorded, USED, and written at least as far as the row attends in it (the read
// check, KVPool.verify). The Python functions that do this one tensor op at a time
// are the reference; this is the same conditions in one pass, without the ~30 small
// tensor ops (a third of a millisecond per step, measured).
//
// It is a fast path, never a second definition: it returns 0 only when every check
// the reference makes passes. On any refusal, or any input it does not expect (a
// malformed row index, a slot or page outside the pool), it returns nonzero and the
// caller runs the reference, which raises the explained IsolationViolation (or the
// error it always raised). A write-check refusal returns before the pool is touched;
// a read-check refusal after the marking, exactly where the reference raises.
#include <algorithm>
#include <cstdint>
#include <vector>

// The step and the pool's ledger, field for field with step_checks.py's _Step.
struct Step {
  int64_t rows, width, tokens;
  const int64_t* pages;  // [rows, width] at (pages_s0, pages_s1) element strides
  const int64_t* generations;
  const int64_t* owners;
  int64_t pages_s0, pages_s1, gens_s0, gens_s1, owners_s0, owners_s1;
  const bool* valid;          // [rows, width], contiguous: false for padding
  const int64_t* readers;     // [rows]
  const int64_t* namespaces;  // [rows]
  const int64_t* lengths;     // [rows] positions attended after the step
  const int64_t* query_starts;  // [rows + 1] the rows' first new tokens
  const int64_t* positions;   // [tokens]
  const int64_t* slots;       // [tokens] pool slot each new token's K/V goes to
  const int64_t* owner;       // the ledger's columns, [num_pages]
  const int64_t* generation;
  const int8_t* state;
  int64_t* written;  // slots [0, n) of the page hold data
  int64_t num_pages, page_size, used_state;
  int check;  // 0 under the lab's no-ledger-check fault: only mark the writes
};

enum { PASSED = 0, WRITE_REFUSED = 1, READ_REFUSED = 2 };

static bool rows_well_formed(const Step& s) {
  if (s.rows < 1 || s.width < 0 || s.query_starts[0] != 0 || s.query_starts[s.rows] != s.tokens)
    return false;
  for (int64_t r = 0; r < s.rows; ++r)
    if (s.query_starts[r + 1] < s.query_starts[r]) return false;
  return true;
}

// attention._check_slots: the slot is pages[row, pos / ps] * ps + pos % ps, inside the table.
static bool writes_entitled(const Step& s) {
  const int64_t ps = s.page_size;
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t t = s.query_starts[r]; t < s.query_starts[r + 1]; ++t) {
      const int64_t pos = s.positions[t];
      if (pos < 0 || pos >= s.lengths[r]) return false;
      const int64_t col = pos / ps;
      if (col >= s.width || !s.valid[r * s.width + col]) return false;
      const int64_t page = s.pages[r * s.pages_s0 + col * s.pages_s1];
      if (page < 0 || page >= s.num_pages) return false;  // before page * ps can overflow
      if (page * ps + pos % ps != s.slots[t]) return false;
    }
  }
  return true;
}

struct Touched {
  int64_t page, lo, hi;  // offsets [lo, hi) of the page written this step
};

// attention._mark_written: per touched page, the written prefix grows to the highest
// offset written only if the lowest one does not leave a hole. False (nothing marked)
// when a slot lies outside the pool.
static bool mark_written(const Step& s) {
  const int64_t ps = s.page_size;
  std::vector<Touched> runs;  // consecutive tokens on one page make one run
  for (int64_t t = 0; t < s.tokens; ++t) {
    const int64_t slot = s.slots[t];
    if (slot < 0 || slot >= s.num_pages * ps) return false;
    const int64_t page = slot / ps, off = slot % ps;
    if (!runs.empty() && runs.back().page == page) {
      runs.back().lo = std::min(runs.back().lo, off);
      runs.back().hi = std::max(runs.back().hi, off + 1);
    } else {
      runs.push_back({page, off, off + 1});
    }
  }
  std::sort(runs.begin(), runs.end(),
            [](const Touched& a, const Touched& b) { return a.page < b.page; });
  for (size_t i = 0; i < runs.size();) {  // every run of one page merged, as torch.unique does
    Touched m = runs[i];
    for (++i; i < runs.size() && runs[i].page == m.page; ++i) {
      m.lo = std::min(m.lo, runs[i].lo);
      m.hi = std::max(m.hi, runs[i].hi);
    }
    if (s.written[m.page] >= m.lo) s.written[m.page] = std::max(s.written[m.page], m.hi);
  }
  return true;
}

// KVPool.verify: each valid entry is the reader's (or its namespace's), current, USED and
// written as far as the row attends in it; no row attends past its table. Padding entries
// must name a page inside the pool too (the reference indexes them).
static bool reads_entitled(const Step& s) {
  const int64_t ps = s.page_size;
  for (int64_t r = 0; r < s.rows; ++r) {
    int64_t covered = 0;
    for (int64_t c = 0; c < s.width; ++c) {
      const int64_t page = s.pages[r * s.pages_s0 + c * s.pages_s1];
      if (page < 0 || page >= s.num_pages) return false;
      if (!s.valid[r * s.width + c]) continue;
      ++covered;
      const int64_t who = s.owners[r * s.owners_s0 + c * s.owners_s1];
      const int64_t needed = std::clamp(s.lengths[r] - c * ps, int64_t{0}, ps);
      const int64_t gen = s.generations[r * s.gens_s0 + c * s.gens_s1];
      if (s.owner[page] != who || s.generation[page] != gen || s.state[page] != s.used_state ||
          (who != s.readers[r] && who != s.namespaces[r]) || s.written[page] < needed)
        return false;
    }
    if (s.lengths[r] > covered * ps) return false;
  }
  return true;
}

extern "C" int kvf_step_checks(const Step* step) {
  const Step& s = *step;
  if (!rows_well_formed(s) || s.page_size < 1) return WRITE_REFUSED;
  if (s.check && !writes_entitled(s)) return WRITE_REFUSED;
  if (!mark_written(s)) return WRITE_REFUSED;
  if (s.check && !reads_entitled(s)) return READ_REFUSED;
  return PASSED;
}
