"""The policy losses' configs: the run config's `loss` section, one frozen dataclass per loss, torch-free.

They live apart from the loss functions (algorithms/losses/<name>.py, which import torch) so that reading and
checking a run config (`megatron-dapo check | plan | status`, `import megatron_dapo`) never imports torch: the names
`algorithm.policy_loss` accepts and each loss's fields are registered here (config.register_choices), and each loss
function registers under the same name with its config class (policy_loss.register_policy_loss).

Adding a loss: its config class here (a frozen `PolicyLossConfig` subclass, in LOSS_CONFIGS), its function in
algorithms/losses/<name>.py, its test.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any
from typing import ClassVar

from megatron_dapo.config import register_choices

LOSS_DENOMINATOR_UNIT = {
    "token-mean": "tokens",
    "seq-mean-token-mean": "sequences",
    "seq-mean-token-sum": "sequences",
    "seq-mean-token-sum-norm": "sequences",
}
"""Each aggregation (`agg_loss`) and what its global denominator D counts: valid tokens, or responses with at least
one valid token."""
LOSS_AGG_MODES = tuple(LOSS_DENOMINATOR_UNIT)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Base of every policy loss's config (the run config's `loss` section holds the selected loss's fields).

    Subclasses are frozen dataclasses with a `loss_agg_mode` (a field, or a ClassVar where the loss fixes it; the
    actor reads it for the loss denominator's unit); `AGG_MODES` lists the aggregations the loss accepts (a config
    naming another is refused with one line), `check()` raises ValueError("field: message") for any other rule."""

    AGG_MODES: ClassVar[tuple[str, ...]] = LOSS_AGG_MODES
    std_normalize: bool = True
    """Advantages (R - mean) / (std + eps) per group (True) or R - mean (Dr. GRPO)."""

    loss_agg_mode: ClassVar[str] = "token-mean"

    def resolve(self, *, max_response_length: int) -> PolicyLossConfig:
        """This config with what depends on the rest of the run filled in (RunConfig calls it); default: itself."""
        return self

    def check(self) -> None:
        if self.loss_agg_mode not in self.AGG_MODES:
            raise ValueError(
                f"loss_agg_mode: must be one of {list(self.AGG_MODES)} for this loss, got {self.loss_agg_mode!r}"
            )


def _check_clip_range(eps_low: float, eps_high: float) -> None:
    """The clip range's rule (DAPO's ratio, GSPO's sequence ratio): eps_low in (0, 1), eps_high in (0, 10]."""
    if not 0 < eps_low < 1:
        raise ValueError(f"eps_low: must be in (0, 1), got {eps_low}")
    if not 0 < eps_high <= 10:
        raise ValueError(f"eps_high: must be in (0, 10], got {eps_high}")


@dataclass(frozen=True)
class DAPOConfig(PolicyLossConfig):
    """The paper's loss: ratio clipped to [1 - eps_low, 1 + eps_high], sum over all valid tokens / their count."""

    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip range (Clip-Higher): the ratio is clipped above at 1 + eps_high."""
    clip_higher: bool = True
    """Ablation switch: False uses eps_high = eps_low (symmetric PPO clip)."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -A*c; None disables it."""
    loss_agg_mode: str = "token-mean"
    """"token-mean" (DAPO), or "seq-mean-token-mean" / "seq-mean-token-sum" for ablations."""

    AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        _check_clip_range(self.eps_low, self.eps_high)
        if self.eps_high < self.eps_low:
            raise ValueError(f"eps_high: must be >= eps_low {self.eps_low}, got {self.eps_high}")
        if self.clip_ratio_c is not None and not 1 < self.clip_ratio_c <= 100:
            raise ValueError(f"clip_ratio_c: must be in (1, 100] (or null), got {self.clip_ratio_c}")

    @property
    def effective_eps_high(self) -> float:
        return self.eps_high if self.clip_higher else self.eps_low


@dataclass(frozen=True)
class GRPOConfig(PolicyLossConfig):
    """GRPO's clipped surrogate."""

    eps: float = 0.2
    """Symmetric clip range: the ratio is clipped to [1 - eps, 1 + eps]."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None disables it."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """GRPO's per-response token mean averaged over responses; "token-mean" / "seq-mean-token-sum" for ablations."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to a frozen reference model (`policy_loss.kl_k3`, aggregated as the policy term;
    DeepSeekMath used 0.04). 0, the default as in DAPO and Dr. GRPO: no term and no reference model. > 0: the trainer
    builds the reference, a second frozen Megatron model of actor.model_path (docs/memory.md, "Reference model")."""

    AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps: must be in (0, 1), got {self.eps}")
        if self.clip_ratio_c is not None and not 1 < self.clip_ratio_c <= 100:
            raise ValueError(f"clip_ratio_c: must be in (1, 100] (or null), got {self.clip_ratio_c}")
        if not 0.0 <= self.kl_coef <= 10.0:
            raise ValueError(f"kl_coef: must be in [0, 10], got {self.kl_coef}")


@dataclass(frozen=True)
class DrGRPOConfig(PolicyLossConfig):
    """Dr. GRPO's loss: symmetric clip, seq-mean of token sums / norm_length, unnormalised advantages."""

    eps: float = 0.2
    """Symmetric clip range."""
    norm_length: int = 0
    """The constant each response's token sum is divided by; 0: rollout.max_response_length (the paper's choice,
    resolved when the run config is built)."""
    std_normalize: bool = False
    """Dr. GRPO drops the std normalisation; True restores GRPO's advantages (ablation)."""

    loss_agg_mode: ClassVar[str] = "seq-mean-token-sum-norm"

    def resolve(self, *, max_response_length: int) -> DrGRPOConfig:
        return dataclasses.replace(self, norm_length=max_response_length) if self.norm_length == 0 else self

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps: must be in (0, 1), got {self.eps}")
        if not 0 <= self.norm_length <= 2**20:
            raise ValueError(f"norm_length: must be in [0, {2**20}] (0: rollout.max_response_length)")


@dataclass(frozen=True)
class GSPOConfig(PolicyLossConfig):
    """GSPO's sequence-level clip; the paper's defaults (its section 5.1: 3e-4 left, 4e-4 right)."""

    eps_low: float = 3e-4
    """The sequence ratio is clipped below at 1 - eps_low."""
    eps_high: float = 4e-4
    """The sequence ratio is clipped above at 1 + eps_high."""

    # Fixed: with each response's token mean the per-token gradient -A s_i / |y_i| is the sequence objective's.
    loss_agg_mode: ClassVar[str] = "seq-mean-token-mean"

    def check(self) -> None:
        PolicyLossConfig.check(self)
        _check_clip_range(self.eps_low, self.eps_high)


@dataclass(frozen=True)
class CISPOConfig(PolicyLossConfig):
    """CISPO's IS-weight cap."""

    eps_high_is: float = 0.28
    """The IS weight is capped at 1 + eps_high_is (the paper tunes only this bound; 0.28 caps it where DAPO clips)."""
    eps_low_is: float | None = None
    """Optional floor 1 - eps_low_is of the IS weight; None (the paper's choice): no floor."""
    loss_agg_mode: str = "token-mean"
    """The paper's token-level sum / count; the sequence means for ablations."""

    AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps_high_is <= 100:
            raise ValueError(f"eps_high_is: must be in (0, 100], got {self.eps_high_is}")
        if self.eps_low_is is not None and not 0 < self.eps_low_is < 1:
            raise ValueError(f"eps_low_is: must be in (0, 1) or null, got {self.eps_low_is}")


LOSS_CONFIGS: dict[str, type[PolicyLossConfig]] = {}
"""{`algorithm.policy_loss` name: its config class}: the built-in losses below, and any registered later."""


def make_loss_config(name: str, values: dict[str, Any] | None = None) -> PolicyLossConfig:
    """The config of loss `name` from {field: value} (already type-converted); ValueError "field: message" on an
    unknown field or a broken rule."""
    config_cls = LOSS_CONFIGS[name]
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of policy loss {name!r}; its fields: {sorted(known)}")
    cfg = config_cls(**values)
    cfg.check()
    return cfg


def register_loss_config(name: str, config_cls: type[PolicyLossConfig]) -> None:
    """Declare loss `name` with its config class: a value of `algorithm.policy_loss` (the loss's function registers
    under it with policy_loss.register_policy_loss). The same pair twice is a no-op; another class is an error."""
    if name in LOSS_CONFIGS:
        if LOSS_CONFIGS[name] is not config_cls:
            raise ValueError(f"policy loss {name!r} is already registered with {LOSS_CONFIGS[name].__name__}")
        return
    LOSS_CONFIGS[name] = config_cls
    register_choices("algorithm.policy_loss", name, payload=functools.partial(make_loss_config, name))


for _name, _cls in (("dapo", DAPOConfig), ("grpo", GRPOConfig), ("dr_grpo", DrGRPOConfig), ("gspo", GSPOConfig),
                    ("cispo", CISPOConfig)):  # fmt: skip
    register_loss_config(_name, _cls)


def uses_reference(config: PolicyLossConfig) -> bool:
    """Whether a loss config needs a frozen reference model's log-probs (a KL term: `kl_coef` > 0)."""
    return float(getattr(config, "kl_coef", 0.0)) > 0.0
