// Elementwise math in a form the compiler vectorizes inside `#pragma omp simd` loops (the C library's
// expf is a call per element).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) = 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
// (relative error ~1e-7); x is clamped to [-87, 88], where the result stays a normal float.
inline float vexp(float x) {
  const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.6931471805599453f;  // back to natural-log units: 2^(t-n) = e^f
  const float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
