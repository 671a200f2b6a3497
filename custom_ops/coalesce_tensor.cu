// paddle_hybrid: CUDA kernels of `ph_coalesce_tensor`: copy into the fused
// buffer and fill it with a constant.  Built only when Paddle is compiled with
// CUDA (see setup.py); compiled by tests/ops/test_build.py with nvcc wherever
// nvcc is on PATH.

#include <cuda_runtime.h>

#include <cstdint>

#include "coalesce_tensor.h"

namespace paddle_hybrid {
namespace {

template <typename T>
__global__ void FillKernel(T* dst, int64_t numel, T value) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    dst[i] = value;
  }
}

template <typename T>
const char* LaunchFill(void* dst, int64_t numel, uint64_t pattern, cudaStream_t stream) {
  constexpr int kThreads = 256;
  int64_t blocks = (numel + kThreads - 1) / kThreads;
  if (blocks > 65535) blocks = 65535;
  if (blocks < 1) blocks = 1;
  FillKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<T*>(dst), numel, static_cast<T>(pattern));
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* CudaCopyBytes(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return nullptr;
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                    static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* CudaFillPattern(void* dst, int64_t numel, int elem_size, uint64_t pattern,
                            void* stream_ptr) {
  if (numel <= 0) return nullptr;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (elem_size) {
    case 1:
      return LaunchFill<uint8_t>(dst, numel, pattern, stream);
    case 2:
      return LaunchFill<uint16_t>(dst, numel, pattern, stream);
    case 4:
      return LaunchFill<uint32_t>(dst, numel, pattern, stream);
    case 8:
      return LaunchFill<uint64_t>(dst, numel, pattern, stream);
    default:
      return "ph_coalesce_tensor: unsupported element size for fill";
  }
}

}  // namespace paddle_hybrid
