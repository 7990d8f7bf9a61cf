// CUDA C++ twin of megatron_dapo.ops.logprobs_and_entropy (single rank, plus class_start / n_valid for a vocab
// shard). One thread block per token row runs an online softmax over the row's V_local logits.
//
// Per-row state kept by each thread: m (running max of z = x / T), s = sum exp(z - m) and
// w = sum exp(z - m) * (z - m). Keeping w relative to m (not sum p * z) avoids the cancellation of
// lse - sum p z when logits are large. From the merged state: lse = m + log s, entropy = log s - w / s.
//
// Outputs follow ops/reference.py: stats [3, T] fp32 = (shard lse, shard entropy, target logit z_y or 0 when the
// label is not in this shard). With one rank, logp = z_y - lse. With a tensor-parallel group the Python wrapper
// merges stats across ranks (reference.combine_vocab_shards) before logp = z_y - lse; the backward then needs the
// global (lse, entropy) only, no communication.
#include "common.cuh"

namespace mdapo {
namespace {

constexpr int kRowThreads = 256;

struct SoftmaxState {
  float m, s, w;
};

__device__ __forceinline__ SoftmaxState merge(SoftmaxState a, SoftmaxState b) {
  if (a.s == 0.f) return b;  // empty state (m = -inf): nothing to rescale
  if (b.s == 0.f) return a;
  const float m = fmaxf(a.m, b.m);
  const float ea = expf(a.m - m), eb = expf(b.m - m);
  // sum exp(z - m')(z - m') = exp(m - m') * (w + (m - m') * s) for a state relative to m
  SoftmaxState r;
  r.m = m;
  r.s = a.s * ea + b.s * eb;
  r.w = ea * (a.w + (a.m - m) * a.s) + eb * (b.w + (b.m - m) * b.s);
  return r;
}

__device__ __forceinline__ void update(SoftmaxState& st, float z) {
  if (z == -INFINITY) return;  // probability 0 (masked vocab entries)
  if (st.s == 0.f) {
    st = {z, 1.f, 0.f};
  } else if (z > st.m) {
    const float e = expf(st.m - z);
    st.w = e * (st.w + (st.m - z) * st.s);
    st.s = st.s * e + 1.f;
    st.m = z;
  } else {
    const float e = expf(z - st.m);
    st.s += e;
    st.w += e * (z - st.m);
  }
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads) logprob_entropy_fwd_kernel(
    const T* __restrict__ logits, int64_t row_stride, const int64_t* __restrict__ labels, int64_t num_rows,
    int64_t n_cols, int64_t n_valid, int64_t class_start, float inv_temp, float* __restrict__ stats,
    float* __restrict__ logp) {
  __shared__ float sh_m[kRowThreads / kWarp], sh_s[kRowThreads / kWarp], sh_w[kRowThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  SoftmaxState st = {-INFINITY, 0.f, 0.f};
  for (int64_t j = threadIdx.x; j < n_valid; j += blockDim.x) update(st, to_float(x[j]) * inv_temp);
  // warp tree, then warp 0 merges the warp results in a fixed order (deterministic)
  for (int off = kWarp / 2; off > 0; off /= 2) {
    SoftmaxState o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    o.w = __shfl_xor_sync(0xffffffffu, st.w, off);
    st = merge(st, o);
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) {
    sh_m[warp] = st.m;
    sh_s[warp] = st.s;
    sh_w[warp] = st.w;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  SoftmaxState total = {sh_m[0], sh_s[0], sh_w[0]};
  for (int w = 1; w < (int)(blockDim.x / kWarp); ++w) total = merge(total, {sh_m[w], sh_s[w], sh_w[w]});
  const int64_t y = labels[row] - class_start;
  const float zy = (y >= 0 && y < n_valid) ? to_float(x[y]) * inv_temp : 0.f;
  float lse = -INFINITY, ent = 0.f;
  if (total.s > 0.f) {
    const float log_s = logf(total.s);
    lse = total.m + log_s;
    ent = log_s - total.w / total.s;
  }
  stats[row] = lse;
  stats[num_rows + row] = ent;
  stats[2 * num_rows + row] = zy;
  if (logp != nullptr) logp[row] = zy - lse;
}

// d(g_logp * logp + g_ent * H) / dx_j = (g_logp * ([j == y] - p_j) - g_ent * p_j * (log p_j + H)) / T
template <typename T>
__global__ void __launch_bounds__(kRowThreads) logprob_entropy_bwd_kernel(
    const T* __restrict__ logits, int64_t row_stride, const int64_t* __restrict__ labels, int64_t num_rows,
    int64_t n_cols, int64_t n_valid, int64_t class_start, float inv_temp, const float* __restrict__ stats,
    const float* __restrict__ grad_logp, const float* __restrict__ grad_entropy, T* __restrict__ grad_logits,
    int64_t grad_row_stride) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  T* g = grad_logits + row * grad_row_stride;
  const float lse = stats[row], ent = stats[num_rows + row];
  const float g_lp = grad_logp != nullptr ? grad_logp[row] : 0.f;
  const float g_h = grad_entropy != nullptr ? grad_entropy[row] : 0.f;
  const int64_t y = labels[row] - class_start;
  for (int64_t j = threadIdx.x; j < n_cols; j += blockDim.x) {
    float d = 0.f;
    if (j < n_valid) {
      const float logp_j = to_float(x[j]) * inv_temp - lse;
      const float p = expf(logp_j);
      if (p > 0.f) d = -g_lp * p - g_h * p * (logp_j + ent);
      if (j == y) d += g_lp;
    }
    g[j] = from_float<T>(d * inv_temp);
  }
}

template <typename T>
cudaError_t launch_fwd(const void* logits, int64_t row_stride, const int64_t* labels, int64_t num_rows,
                       int64_t n_cols, int64_t n_valid, int64_t class_start, float inv_temp, float* stats,
                       float* logp, cudaStream_t stream) {
  logprob_entropy_fwd_kernel<T><<<(unsigned)num_rows, kRowThreads, 0, stream>>>(
      static_cast<const T*>(logits), row_stride, labels, num_rows, n_cols, n_valid, class_start, inv_temp, stats,
      logp);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const void* logits, int64_t row_stride, const int64_t* labels, int64_t num_rows,
                       int64_t n_cols, int64_t n_valid, int64_t class_start, float inv_temp, const float* stats,
                       const float* grad_logp, const float* grad_entropy, void* grad_logits, int64_t grad_row_stride,
                       cudaStream_t stream) {
  logprob_entropy_bwd_kernel<T><<<(unsigned)num_rows, kRowThreads, 0, stream>>>(
      static_cast<const T*>(logits), row_stride, labels, num_rows, n_cols, n_valid, class_start, inv_temp, stats,
      grad_logp, grad_entropy, static_cast<T*>(grad_logits), grad_row_stride);
  return cudaGetLastError();
}

}  // namespace
}  // namespace mdapo

extern "C" {

// logits: [num_rows, n_cols] with unit column stride, dtype code `dtype` (0 fp32, 1 fp16, 2 bf16);
// labels: [num_rows] int64 global ids; columns >= n_valid are padding; stats: [3, num_rows] fp32 out;
// logp: [num_rows] fp32 out or NULL. Returns a cudaError_t (0 = success).
int mdapo_logprob_entropy_fwd(const void* logits, int64_t row_stride, int dtype, const int64_t* labels,
                              int64_t num_rows, int64_t n_cols, int64_t n_valid, int64_t class_start,
                              float temperature, float* stats, float* logp, cudaStream_t stream) {
  if (num_rows == 0) return 0;
  if (num_rows > 2147483647LL || !(temperature > 0.f)) return (int)cudaErrorInvalidValue;
  const float inv_temp = 1.f / temperature;
  switch (dtype) {
    case mdapo::kFloat32:
      return mdapo::launch_fwd<float>(logits, row_stride, labels, num_rows, n_cols, n_valid, class_start, inv_temp,
                                      stats, logp, stream);
    case mdapo::kFloat16:
      return mdapo::launch_fwd<__half>(logits, row_stride, labels, num_rows, n_cols, n_valid, class_start, inv_temp,
                                       stats, logp, stream);
    case mdapo::kBFloat16:
      return mdapo::launch_fwd<__nv_bfloat16>(logits, row_stride, labels, num_rows, n_cols, n_valid, class_start,
                                              inv_temp, stats, logp, stream);
    default:
      return (int)cudaErrorInvalidValue;
  }
}

// stats: [3, num_rows] fp32 GLOBAL (lse, entropy, .) after any vocab-parallel merge; grad_logp / grad_entropy:
// [num_rows] fp32 or NULL (zero); grad_logits: [num_rows, n_cols] out, same dtype as logits.
int mdapo_logprob_entropy_bwd(const void* logits, int64_t row_stride, int dtype, const int64_t* labels,
                              int64_t num_rows, int64_t n_cols, int64_t n_valid, int64_t class_start,
                              float temperature, const float* stats, const float* grad_logp,
                              const float* grad_entropy, void* grad_logits, int64_t grad_row_stride,
                              cudaStream_t stream) {
  if (num_rows == 0) return 0;
  if (num_rows > 2147483647LL || !(temperature > 0.f)) return (int)cudaErrorInvalidValue;
  const float inv_temp = 1.f / temperature;
  switch (dtype) {
    case mdapo::kFloat32:
      return mdapo::launch_bwd<float>(logits, row_stride, labels, num_rows, n_cols, n_valid, class_start, inv_temp,
                                      stats, grad_logp, grad_entropy, grad_logits, grad_row_stride, stream);
    case mdapo::kFloat16:
      return mdapo::launch_bwd<__half>(logits, row_stride, labels, num_rows, n_cols, n_valid, class_start, inv_temp,
                                       stats, grad_logp, grad_entropy, grad_logits, grad_row_stride, stream);
    case mdapo::kBFloat16:
      return mdapo::launch_bwd<__nv_bfloat16>(logits, row_stride, labels, num_rows, n_cols, n_valid, class_start,
                                              inv_temp, stats, grad_logp, grad_entropy, grad_logits,
                                              grad_row_stride, stream);
    default:
      return (int)cudaErrorInvalidValue;
  }
}

const char* mdapo_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

int mdapo_abi_version(void) { return 3; }  // 3: pg entry points take kind, seq_lr, seq_ids; mdapo_seq_log_ratio

}  // extern "C"
