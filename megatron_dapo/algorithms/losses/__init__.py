"""The policy losses: one file each, its config dataclass and one function, registered under its
`algorithm.policy_loss` name (megatron_dapo.algorithms.policy_loss.POLICY_LOSSES).

    dapo     clip [1 - 0.2, 1 + 0.28], token-mean                      (DAPO, arXiv 2503.14476)
    grpo     clip [0.8, 1.2], seq-mean-token-mean                       (DeepSeekMath, arXiv 2402.03300)
    dr_grpo  clip [0.8, 1.2], seq-mean-token-sum / L_max, A = R - mean  (Dr. GRPO, arXiv 2503.20783)
    gspo     sequence-ratio clip [1 - 3e-4, 1 + 4e-4], seq-mean-token-mean  (GSPO, arXiv 2507.18071)
    cispo    -sg(min(r, 1 + 0.28)) A logp, token-mean                   (MiniMax-M1, arXiv 2506.13585)

Adding a loss: a new file here with a frozen `PolicyLossConfig` subclass and a function registered with
`@register_policy_loss(name, ConfigClass)`, imported below, plus its test. The fused kernel
(`ops.pg_loss.fused_surrogate_loss`) runs every loss that is one of `policy_loss.SURROGATES`.
"""

from megatron_dapo.algorithms.losses import cispo
from megatron_dapo.algorithms.losses import dapo
from megatron_dapo.algorithms.losses import dr_grpo
from megatron_dapo.algorithms.losses import grpo
from megatron_dapo.algorithms.losses import gspo

__all__ = ["cispo", "dapo", "dr_grpo", "grpo", "gspo"]
