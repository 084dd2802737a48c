// The kernels' vector type: 16 floats, one AVX-512 register (two AVX2 ones where
// that is all the machine has), written with GCC's vector extension so that one
// source compiles to either with -march=native.
#pragma once

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

}  // namespace kvf
