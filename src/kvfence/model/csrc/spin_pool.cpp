// The pool behind kvf::run_parts (spin_pool.h says why it exists).
#include "spin_pool.h"

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace kvf {
namespace {

constexpr int64_t kIdleSpinNs = 2'000'000;  // a worker sleeps after 2 ms without work

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Pool {
 public:
  // Runs the parts, or returns false at once if another caller holds the pool.
  bool run(int parts, PartBody body, void* ctx) {
    std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
    if (!caller.owns_lock()) return false;
    grow(parts - 1);
    body_ = body;
    ctx_ = ctx;
    parts_ = parts;
    pending_.store(static_cast<int>(threads_.size()));  // every worker checks in: no stragglers
    generation_.fetch_add(1);  // publishes body_, ctx_, parts_ (seq_cst)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(sleep_);
      wake_.notify_all();
    }
    body(ctx, 0, parts);
    while (pending_.load() > 0) sched_yield();
    return true;
  }

 private:
  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      const int index = static_cast<int>(threads_.size()) + 1;
      const uint64_t start = generation_.load();  // before run() publishes the first work
      threads_.emplace_back([this, index, start] { work(index, start); });
      threads_.back().detach();  // lives as long as the process
    }
  }

  void work(int index, uint64_t seen) {
    for (;;) {
      wait_past(seen);
      seen = generation_.load();
      if (index < parts_) body_(ctx_, index, parts_);
      pending_.fetch_sub(1);
    }
  }

  void wait_past(uint64_t seen) {
    const int64_t until = now_ns() + kIdleSpinNs;
    for (int i = 0;; ++i) {
      if (generation_.load() != seen) return;
      sched_yield();
      if ((i & 63) == 63 && now_ns() > until) break;
    }
    std::unique_lock<std::mutex> lk(sleep_);
    sleepers_.fetch_add(1);  // before the check below: run() sees a sleeper or we see its work
    wake_.wait(lk, [&] { return generation_.load() != seen; });
    sleepers_.fetch_sub(1);
  }

  std::mutex caller_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
  PartBody body_ = nullptr;
  void* ctx_ = nullptr;
  int parts_ = 0;
};

Pool& pool() {
  // One pool per process; a forked child (whose copy has no threads) makes its own.
  static std::atomic<Pool*> current{nullptr};
  static std::atomic<pid_t> owner{0};
  const pid_t pid = getpid();
  Pool* p = current.load();
  if (p == nullptr || owner.load() != pid) {
    static std::mutex making;
    std::lock_guard<std::mutex> lk(making);
    p = current.load();
    if (p == nullptr || owner.load() != pid) {
      p = new Pool();  // never freed: its detached workers use it until the process ends
      current.store(p);
      owner.store(pid);
    }
  }
  return *p;
}

}  // namespace

void run_parts(int parts, PartBody body, void* ctx) {
  if (!pool().run(parts, body, ctx)) {
    for (int part = 0; part < parts; ++part) body(ctx, part, parts);  // the pool is busy
  }
}

}  // namespace kvf
