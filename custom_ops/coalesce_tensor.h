// paddle_hybrid: the CUDA side of `ph_coalesce_tensor` (coalesce_tensor.cu).
//
// Deliberately free of Paddle headers so the .cu file compiles with any nvcc:
// the host code (coalesce_tensor.cc) converts the constant to the target
// dtype's bit pattern with Paddle's own types, and the device code only
// copies bytes and repeats a 1/2/4/8-byte pattern.
#pragma once

#include <cstddef>
#include <cstdint>

namespace paddle_hybrid {

// Each returns nullptr on success, else a static error message.
// Copies `bytes` bytes from `src` to `dst` (device memory) on `stream`.
const char* CudaCopyBytes(void* dst, const void* src, size_t bytes, void* stream);
// Writes `pattern`'s low `elem_size` bytes (1, 2, 4 or 8) into each of the
// `numel` elements at `dst` (device memory) on `stream`.
const char* CudaFillPattern(void* dst, int64_t numel, int elem_size, uint64_t pattern,
                            void* stream);

}  // namespace paddle_hybrid
