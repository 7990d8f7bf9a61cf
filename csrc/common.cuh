// Shared helpers of the megatron_dapo CUDA C++ twins. The C ABI (extern "C" functions in the .cu files) takes raw
// device pointers, sizes and a cudaStream_t only: no torch headers, so the library builds with plain nvcc and is
// bound from Python with ctypes + torch.library (megatron_dapo/ops/_cuda_twins.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace mdapo {

// dtype codes used across the C ABI (must match _cuda_twins.py)
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int kWarp = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Deterministic block-wide sum: fixed shuffle tree inside each warp, then warp 0 sums the warp results in order.
// `shared` needs blockDim.x / 32 floats. The result is valid in every thread.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, num_warps = blockDim.x / kWarp;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += shared[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* shared) {
  for (int off = kWarp / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, num_warps = blockDim.x / kWarp;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = shared[0];
  for (int w = 1; w < num_warps; ++w) total = fmaxf(total, shared[w]);
  return total;
}

}  // namespace mdapo
