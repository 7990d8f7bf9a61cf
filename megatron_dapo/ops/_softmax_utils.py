"""Shared @triton.jit pieces of the log-prob / entropy kernels: the online-softmax step and its gradient.

Numerics (all fp32, z = logits / temperature, one row per token):
- Online state per row: m (running max), s = sum exp(z - m), t = sum exp(z - m) * (z - m). On a new max m' both are
  rescaled by exp(m - m'), and t also gains s * (m - m') because every (z - m) shifts by that amount.
- lse = m + log s; entropy H = -sum p log p = log s - t / s. Keeping t relative to the max avoids computing H as the
  difference of two large numbers (lse - E_p[z]), which loses ~1e-3 absolute at |z| ~ 1e4 in fp32.
- Masked columns enter as z = -inf: they add exp(-inf) = 0 to s, and `e * where(e > 0, z - m, 0)` keeps
  0 * (-inf) out of t.
  A row that has seen only -inf so far keeps m = -inf; m_safe = 0 then avoids exp(-inf - (-inf)) = nan.
- Gradient: with p_j = exp(z_j - lse), d logp / dz_j = [j == label] - p_j and d H / dz_j = -p_j (log p_j + H)
  (from H = lse - sum p z and dp_i/dz_j = p_i ([i == j] - p_j)). The logits gradient is that times 1 / temperature.
"""

import triton
import triton.language as tl


@triton.jit
def online_softmax_update(z, m, s, t):
    """One online-softmax step. z: [BLOCK_T, BLOCK_V] fp32 (-inf where masked); m, s, t: [BLOCK_T] fp32."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_safe)
    # s > 0 implies m is finite, so (m - m_safe) is finite wherever it is used.
    shift = tl.where(s > 0.0, m - m_safe, 0.0)
    zc = z - m_safe[:, None]
    e = tl.exp(zc)
    d = e * tl.where(e > 0.0, zc, 0.0)  # never forms 0 * (-inf)
    s_new = s * scale + tl.sum(e, axis=1)
    t_new = scale * (t + s * shift) + tl.sum(d, axis=1)
    return m_new, s_new, t_new


@triton.jit
def online_softmax_finalize(m, s, t):
    """Turn the online state into (lse, entropy), both [BLOCK_T] fp32. A row with no column gets (-inf, 0)."""
    has = s > 0.0
    s_safe = tl.where(has, s, 1.0)
    log_s = tl.log(s_safe)
    lse = tl.where(has, m + log_s, float("-inf"))
    ent = tl.where(has, log_s - t / s_safe, 0.0)
    return lse, ent


@triton.jit
def target_logit(z, cols, labels_local, n_valid):
    """z at each row's label column, 0 where the label is outside these columns. Returns [BLOCK_T] fp32.

    Only columns < n_valid may match. The last vocab tile overhangs the shard: its masked columns hold -inf, and
    under TP > 1 a label of the NEXT shard whose local index (label - class_start) falls in that overhang would
    otherwise add -inf to this rank's target logit (logp = -inf after the merge).
    """
    hit = (cols[None, :] == labels_local[:, None]) & (cols < n_valid)[None, :]
    return tl.sum(tl.where(hit, z, 0.0), axis=1)


@triton.jit
def logprob_entropy_dz(z, cols, labels_local, lse, ent, g_logp, g_ent):
    """d(g_logp * logp + g_ent * H) / dz for a [BLOCK_T, BLOCK_V] tile; row vectors are [BLOCK_T] fp32."""
    logp = z - lse[:, None]
    p = tl.exp(logp)
    ent_term = p * tl.where(p > 0.0, logp + ent[:, None], 0.0)
    onehot = cols[None, :] == labels_local[:, None]
    return tl.where(onehot, g_logp[:, None], 0.0) - g_logp[:, None] * p - g_ent[:, None] * ent_term
