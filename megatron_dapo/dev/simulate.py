"""A CPU simulation of DAPO's batch construction on a synthetic policy (no model, no network).

Each prompt has a difficulty d; the policy's skill s rises over training; a response is correct with probability
sigmoid(s - d). Responses are real strings scored by the real verifier, lengths get the real overlong shaping, the
real DynamicSampler builds the batch, and the real advantages and token-level loss are computed on it. What it shows
(DAPO section 3.2 and its training-dynamics discussion): early on most groups are all-wrong, late most are all-correct,
and in both regimes dynamic sampling must draw several prompts per useful one; a plain GRPO batch would spend most of
its responses on groups whose advantages are all zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms import Group
from megatron_dapo.algorithms import dapo_policy_loss
from megatron_dapo.algorithms import group_normalized_advantages
from megatron_dapo.algorithms import soft_overlong_penalty
from megatron_dapo.algorithms.dynamic_sampling import sample_step
from megatron_dapo.reward import compute_score


@dataclass
class SimConfig:
    steps: int = 12
    prompts_per_step: int = 32
    gen_prompts_per_batch: int = 32
    group_size: int = 16
    skill_start: float = -3.0
    skill_end: float = 4.0
    max_response_length: int = 256
    overlong_buffer: int = 64
    max_gen_batches: int = 30
    seed: int = 0


def _responses(answer: int, correct: torch.Tensor, gen: torch.Generator) -> list[str]:
    texts = []
    for ok in correct.tolist():
        guess = answer if ok else answer + int(torch.randint(1, 9, (1,), generator=gen))
        texts.append(f"Let me compute step by step.\nAnswer: {guess}")
    return texts


def simulate(cfg: SimConfig) -> list[dict[str, float]]:
    """Run the simulation; returns one metrics dict per step."""
    gen = torch.Generator().manual_seed(cfg.seed)
    sampler = DynamicSampler(
        target_prompts=cfg.prompts_per_step,
        max_sampled_prompts=cfg.max_gen_batches * cfg.gen_prompts_per_batch,
        on_cap="partial",
    )
    rows = []
    for step in range(cfg.steps):
        skill = cfg.skill_start + (cfg.skill_end - cfg.skill_start) * step / max(cfg.steps - 1, 1)

        def generate(_position: int, skill: float = skill) -> Group:
            difficulty = float(torch.randn((), generator=gen)) * 1.5
            answer = int(torch.randint(0, 1000, (1,), generator=gen))
            p = 1.0 / (1.0 + math.exp(-(skill - difficulty)))
            correct = torch.rand(cfg.group_size, generator=gen) < p
            texts = _responses(answer, correct, gen)
            scores = [compute_score(t, answer) for t in texts]
            lengths = torch.randint(32, cfg.max_response_length + 1, (cfg.group_size,), generator=gen)
            reward = torch.tensor([s["score"] for s in scores]) + soft_overlong_penalty(
                lengths, max_response_length=cfg.max_response_length, overlong_buffer=cfg.overlong_buffer
            )
            accs = torch.tensor([s["acc"] for s in scores])
            return Group(accs=accs, payload=(reward, lengths))

        batch, metrics = sample_step(sampler, generate)
        metrics = {"step": float(step), "skill": skill, **metrics}
        if batch:
            rewards = torch.cat([grp.payload[0] for grp in batch])
            lengths = torch.cat([grp.payload[1] for grp in batch])
            adv = group_normalized_advantages(rewards, cfg.group_size)
            # A token-level DAPO loss on this batch at ratio 1 (on-policy first mini-batch): exercised for real.
            t = int(lengths.max())
            mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
            logp = torch.full((len(rewards), t), -1.0, requires_grad=True)
            loss, _ = dapo_policy_loss(logp, logp.detach(), adv, mask)
            loss.backward()
            metrics["train/acc"] = float(torch.cat([grp.accs for grp in batch]).float().mean())
            metrics["train/loss"] = float(loss.detach())
            metrics["train/grad_abs_sum"] = float(logp.grad.abs().sum())
        rows.append(metrics)
    return rows


def format_table(rows: list[dict[str, float]]) -> str:
    head = (
        f"{'step':>4} {'skill':>6} {'sampled':>8} {'kept':>5} {'all_correct':>11} "
        f"{'all_wrong':>9} {'per_useful':>10} {'batch_acc':>9}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{int(r['step']):>4} {r['skill']:>6.2f} {int(r['sampling/prompts_sampled']):>8} "
            f"{int(r['sampling/prompts_kept']):>5} "
            f"{int(r['sampling/groups_all_correct']):>11} {int(r['sampling/groups_all_wrong']):>9} "
            f"{r['sampling/prompts_per_useful']:>10.2f} {r.get('train/acc', float('nan')):>9.3f}"
        )
    return "\n".join(lines)
