// CUDA C++ twin of megatron_dapo.ops.pg_loss.fused_surrogate_loss: every policy loss through one kernel, the
// surrogate chosen by `kind` (policy_loss.SURROGATES, codes pg_loss.KIND_CODES): 0 clip (DAPO / GRPO / Dr. GRPO:
// clipped surrogate, optional dual clip), 1 gspo (the same clip on the sequence's mean log-ratio seq_lr[s], gradient
// -A exp(seq_lr)), 2 cispo (-sg(w) A logp with w = ratio capped at hi, floored at lo; gradient -A w).
// A token's sequence is seq_ids[i] (packed layout) or i / seq_len (padded rows) when seq_ids is null.
//
// Forward = two launches inside one C call: blocks reduce fixed chunks of tokens to 7 partial values written to a
// [num_blocks, 8] workspace, then one block sums the workspace in a fixed order. No float atomics: the totals are
// bitwise reproducible. Totals (fp32 [7]): sum(l * w), sum(w), valid count, clip-high count, clip-low count,
// sum(old_logp - logp) over valid tokens, max ratio over valid tokens (0 if none). Python turns them into the loss
// and metrics exactly as for the Triton kernel.
// Backward = one elementwise launch recomputing ratio and branch; it reads grad_output and 1 / D from device memory.
// Conventions (same as the Triton kernel and policy_loss.clipped_token_loss): branches are decided on the log-ratio
// x = logp - old_logp against log(1 - eps_low), log(1 + eps_high), log(c) (fp32 constants from Python's ClipBounds),
// never on expf(x), whose last bit differs between backends; x exactly on a bound keeps the unclipped gradient
// -A ratio; x is clamped to [-20, 20] before expf (verl's bound) so loss and gradient stay finite, and the unclipped
// gradient is 0 where the clamp is active; masked tokens (w == 0) contribute exactly 0.
#include "common.cuh"

namespace mdapo {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerThread = 8;
constexpr int kChunk = kThreads * kItemsPerThread;

struct PGParams {
  const float* logp;
  const float* old_logp;
  const float* adv;
  const void* mask;
  int mask_is_u8;
  int64_t n;
  int64_t seq_len;
  int adv_per_token;
  float lo, hi, clip_c;
  float log_lo, log_hi, log_c;
  int dual_clip;
  int kind;               // 0 clip, 1 gspo, 2 cispo
  const float* seq_lr;    // [num_seqs] GSPO's mean log-ratio per sequence (kind 1 only)
  const int32_t* seq_ids;  // [n] sequence of each token, or null: i / seq_len
};

constexpr int kKindClip = 0, kKindGSPO = 1, kKindCISPO = 2;  // pg_loss.KIND_CODES

constexpr float kLogRatioClamp = 20.f;  // policy_loss.LOG_RATIO_CLAMP

struct TokenTerms {
  float ratio, token_log_ratio, loss, dloss, adv, w;
  bool clip_high, clip_low;
};

__device__ __forceinline__ TokenTerms token_terms(const PGParams& p, int64_t i) {
  TokenTerms t;
  const float logp = p.logp[i], old = p.old_logp[i];
  const int64_t seq = p.seq_ids != nullptr ? (int64_t)p.seq_ids[i] : i / p.seq_len;
  t.adv = p.adv[p.adv_per_token ? i : seq];
  t.w = p.mask_is_u8 ? (float)static_cast<const uint8_t*>(p.mask)[i] : static_cast<const float*>(p.mask)[i];
  t.token_log_ratio = logp - old;
  const float x = p.kind == kKindGSPO ? p.seq_lr[seq] : t.token_log_ratio;  // the log-ratio the bounds decide on
  t.ratio = expf(fminf(fmaxf(x, -kLogRatioClamp), kLogRatioClamp));
  if (p.kind == kKindCISPO) {
    t.clip_high = x > p.log_hi;
    t.clip_low = x < p.log_lo;
    const float is_w = t.clip_high ? p.hi : (t.clip_low ? p.lo : t.ratio);
    t.loss = -t.adv * is_w * logp;
    t.dloss = -t.adv * is_w;  // sg(w): the gradient of -A w logp never vanishes
    return t;
  }
  t.clip_high = t.adv > 0.f && x > p.log_hi;
  t.clip_low = t.adv < 0.f && x < p.log_lo;
  bool active = !t.clip_high && !t.clip_low && x >= -kLogRatioClamp && x <= kLogRatioClamp;
  t.loss = t.clip_high ? -t.adv * p.hi : (t.clip_low ? -t.adv * p.lo : -t.adv * t.ratio);
  if (p.dual_clip && t.adv < 0.f && x > p.log_c) {
    t.loss = -t.adv * p.clip_c;
    active = false;
  }
  t.dloss = active ? -t.adv * t.ratio : 0.f;  // d(-A ratio)/dlogp = -A ratio
  return t;
}

// GSPO's pass 1: out[s] = mean of logp - old_logp over the valid tokens of sequence s (starts[s] .. starts[s+1]-1);
// one block per sequence, a fixed-order strided loop then a fixed tree: deterministic, no atomics.
__global__ void __launch_bounds__(kThreads) seq_log_ratio_kernel(const float* __restrict__ logp,
                                                                  const float* __restrict__ old_logp,
                                                                  const void* mask, int mask_is_u8,
                                                                  const int32_t* __restrict__ starts,
                                                                  float* __restrict__ out) {
  __shared__ float shared[kThreads / kWarp];
  const int64_t start = starts[blockIdx.x], end = starts[blockIdx.x + 1];
  float total = 0.f, count = 0.f;
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) {
    const float w =
        mask_is_u8 ? (float)static_cast<const uint8_t*>(mask)[i] : static_cast<const float*>(mask)[i];
    if (w == 0.f) continue;
    total += logp[i] - old_logp[i];
    count += 1.f;
  }
  total = block_sum(total, shared);
  count = block_sum(count, shared);
  if (threadIdx.x == 0) out[blockIdx.x] = total / fmaxf(count, 1.f);
}

__global__ void __launch_bounds__(kThreads) pg_loss_partials_kernel(PGParams p, float* __restrict__ partials) {
  __shared__ float shared[kThreads / kWarp];
  float acc[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float rmax = 0.f;
  const int64_t base = (int64_t)blockIdx.x * kChunk;
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int64_t i = base + (int64_t)k * kThreads + threadIdx.x;
    if (i >= p.n) break;
    const TokenTerms t = token_terms(p, i);
    if (t.w == 0.f) continue;
    acc[0] += t.loss * t.w;
    acc[1] += t.w;
    acc[2] += 1.f;
    acc[3] += t.clip_high ? 1.f : 0.f;
    acc[4] += t.clip_low ? 1.f : 0.f;
    acc[5] += -t.token_log_ratio;
    rmax = fmaxf(rmax, t.ratio);
  }
  float* row = partials + (int64_t)blockIdx.x * 8;
  for (int c = 0; c < 6; ++c) {
    const float v = block_sum(acc[c], shared);
    if (threadIdx.x == 0) row[c] = v;
  }
  const float m = block_max(rmax, shared);
  if (threadIdx.x == 0) {
    row[6] = m;
    row[7] = 0.f;
  }
}

// One block: thread t sums rows t, t + blockDim, ... in order, then a fixed tree. Deterministic.
__global__ void __launch_bounds__(kThreads) pg_loss_reduce_kernel(const float* __restrict__ partials, int64_t rows,
                                                                   float* __restrict__ totals) {
  __shared__ float shared[kThreads / kWarp];
  for (int c = 0; c < 7; ++c) {
    float v = 0.f;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const float x = partials[r * 8 + c];
      v = c == 6 ? fmaxf(v, x) : v + x;
    }
    const float total = c == 6 ? block_max(v, shared) : block_sum(v, shared);
    if (threadIdx.x == 0) totals[c] = total;
  }
}

__global__ void __launch_bounds__(kThreads) pg_loss_grad_kernel(PGParams p, const float* __restrict__ grad_out,
                                                                 const float* __restrict__ inv_denom,
                                                                 float* __restrict__ grad) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= p.n) return;
  const TokenTerms t = token_terms(p, i);
  grad[i] = t.w == 0.f ? 0.f : t.dloss * t.w * (grad_out[0] * inv_denom[0]);
}

}  // namespace
}  // namespace mdapo

extern "C" {

// Rows of the [rows, 8] fp32 workspace that mdapo_pg_loss_fwd needs for n tokens.
int64_t mdapo_pg_loss_workspace_rows(int64_t n) { return n <= 0 ? 1 : (n + mdapo::kChunk - 1) / mdapo::kChunk; }

// logp, old_logp: [n] fp32 (a flattened [B, T]); adv: [B] (adv_per_token = 0, seq_len = T) or [n] fp32;
// mask: [n] uint8 (mask_is_u8 = 1) or fp32; lo = 1 - eps_low, hi = 1 + eps_high; clip_c used when dual_clip;
// log_lo, log_hi, log_c: their logs (formed in float64, rounded to fp32), which decide the branches.
// kind: 0 clip, 1 gspo (seq_lr: [num_seqs] fp32 from mdapo_seq_log_ratio), 2 cispo; seq_ids: [n] int32 sequence of
// each token (packed layout) or null (sequence = i / seq_len, advantages per row).
// workspace: [mdapo_pg_loss_workspace_rows(n), 8] fp32 scratch; totals: [7] fp32 out. Returns a cudaError_t.
int mdapo_pg_loss_fwd(const float* logp, const float* old_logp, const float* adv, const void* mask, int mask_is_u8,
                      int64_t n, int64_t seq_len, int adv_per_token, float lo, float hi, float clip_c, float log_lo,
                      float log_hi, float log_c, int dual_clip, int kind, const float* seq_lr, const int32_t* seq_ids,
                      float* workspace, int64_t workspace_rows, float* totals, cudaStream_t stream) {
  const int64_t rows = mdapo_pg_loss_workspace_rows(n);
  if (workspace_rows < rows || seq_len <= 0 || rows > 2147483647LL) return (int)cudaErrorInvalidValue;
  if (kind < 0 || kind > 2 || (kind == 1 && seq_lr == nullptr)) return (int)cudaErrorInvalidValue;
  const mdapo::PGParams p{logp,   old_logp, adv,    mask,   mask_is_u8, n,    seq_len,   adv_per_token, lo,
                          hi,     clip_c,   log_lo, log_hi, log_c,      dual_clip, kind, seq_lr,        seq_ids};
  mdapo::pg_loss_partials_kernel<<<(unsigned)rows, mdapo::kThreads, 0, stream>>>(p, workspace);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return (int)err;
  mdapo::pg_loss_reduce_kernel<<<1, mdapo::kThreads, 0, stream>>>(workspace, rows, totals);
  return (int)cudaGetLastError();
}

// grad: [n] fp32 out = d loss / d logp scaled by grad_out[0] * inv_denom[0] (both fp32 device scalars).
int mdapo_pg_loss_bwd(const float* logp, const float* old_logp, const float* adv, const void* mask, int mask_is_u8,
                      int64_t n, int64_t seq_len, int adv_per_token, float lo, float hi, float clip_c, float log_lo,
                      float log_hi, float log_c, int dual_clip, int kind, const float* seq_lr, const int32_t* seq_ids,
                      const float* grad_out, const float* inv_denom, float* grad, cudaStream_t stream) {
  if (n == 0) return 0;
  const int64_t blocks = (n + mdapo::kThreads - 1) / mdapo::kThreads;
  if (seq_len <= 0 || blocks > 2147483647LL) return (int)cudaErrorInvalidValue;
  if (kind < 0 || kind > 2 || (kind == 1 && seq_lr == nullptr)) return (int)cudaErrorInvalidValue;
  const mdapo::PGParams p{logp,   old_logp, adv,    mask,   mask_is_u8, n,    seq_len,   adv_per_token, lo,
                          hi,     clip_c,   log_lo, log_hi, log_c,      dual_clip, kind, seq_lr,        seq_ids};
  mdapo::pg_loss_grad_kernel<<<(unsigned)blocks, mdapo::kThreads, 0, stream>>>(p, grad_out, inv_denom, grad);
  return (int)cudaGetLastError();
}

// GSPO's pass 1: out [num_seqs] fp32 = mean of logp - old_logp over the valid (mask != 0) tokens of each sequence,
// the tokens starts[s] .. starts[s + 1] - 1 of the flat [n] fp32 inputs (starts: [num_seqs + 1] int32).
int mdapo_seq_log_ratio(const float* logp, const float* old_logp, const void* mask, int mask_is_u8,
                        const int32_t* starts, int64_t num_seqs, float* out, cudaStream_t stream) {
  if (num_seqs == 0) return 0;
  if (num_seqs < 0 || num_seqs > 2147483647LL || starts == nullptr) return (int)cudaErrorInvalidValue;
  mdapo::seq_log_ratio_kernel<<<(unsigned)num_seqs, mdapo::kThreads, 0, stream>>>(logp, old_logp, mask, mask_is_u8,
                                                                                    starts, out);
  return (int)cudaGetLastError();
}

}  // extern "C"
