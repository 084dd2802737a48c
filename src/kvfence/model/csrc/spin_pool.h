// The decode kernels' threads: a small pool whose waits spin while yielding, then sleep.
//
// A decode step calls these kernels a few hundred times, tens of microseconds
// apart. libgomp's waits either sleep at once (OMP_WAIT_POLICY=PASSIVE: every
// call pays a futex wake and a join, +12 ms a step at batch 1 on 2 cores) or
// spin without yielding (a spinning thread holds the core that the thread it
// waits for, or another process, needs: 2x slower on a loaded machine). Here a
// waiting thread calls sched_yield between checks, so on an idle core it reacts
// at once and on a busy one it gives the core away; after kIdleSpinNs with no
// work it sleeps on a condition variable (no CPU between requests).
//
// One caller at a time runs on the pool; a second concurrent caller (two engines
// in one process) runs its work on its own thread instead of waiting.
#pragma once

#include <cstdint>

namespace kvf {

// body(ctx, part, parts) is called once for each part in [0, parts), part 0 on the caller.
using PartBody = void (*)(void* ctx, int part, int parts);

void run_parts(int parts, PartBody body, void* ctx);

// f(part, parts) for each part, in parallel; `parts` <= 1 runs f(0, 1) inline.
template <class F>
void parallel_parts(int parts, F&& f) {
  if (parts <= 1) {
    f(0, 1);
    return;
  }
  auto tramp = [](void* c, int part, int n) { (*static_cast<F*>(c))(part, n); };
  run_parts(parts, tramp, &f);
}

// The contiguous share [begin, end) of n items that `part` of `parts` takes.
inline void share(int64_t n, int part, int parts, int64_t* begin, int64_t* end) {
  *begin = n * part / parts;
  *end = n * (part + 1) / parts;
}

}  // namespace kvf
