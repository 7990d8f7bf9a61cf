"""megatron_dapo.integration: the loss_func factory, the log-prob helper, the --dapo-* arguments and the example."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.algorithms import POLICY_LOSSES
from megatron_dapo.algorithms import dapo_policy_loss
from megatron_dapo.algorithms.losses.dapo import DAPOConfig
from megatron_dapo.algorithms.losses.dr_grpo import DrGRPOConfig
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import ConfigError
from megatron_dapo.integration import add_dapo_args
from megatron_dapo.integration import dapo_config_from_args
from megatron_dapo.integration import dapo_loss_config_from_args
from megatron_dapo.integration import dapo_loss_func
from megatron_dapo.integration import get_logprob_fn
from megatron_dapo.integration import local_loss_denominator
from megatron_dapo.integration import sequence_logprobs_and_entropy
from megatron_dapo.net import free_port

REPO = Path(__file__).resolve().parents[2]
REF = get_logprob_fn("reference")


def _problem(b: int = 6, s: int = 9, v: int = 13, pad: int = 3):
    logits = torch.randn(b, s, v + pad, dtype=torch.float64).float()
    logits[..., v:] = 50.0  # padded vocab columns: huge logits that must not count
    tokens = torch.randint(0, v, (b, s))
    mask = (torch.rand(b, s) < 0.7).float()
    mask[:, 0] = 0.0
    mask[2] = 0.0  # a response without valid tokens
    old = torch.randn(b, s) * 0.1 - 2.0
    adv = torch.randn(b)
    return logits, tokens, mask, old * mask, adv, v


def _oracle_logp(logits: torch.Tensor, tokens: torch.Tensor, v: int, temperature: float) -> torch.Tensor:
    logp_all = torch.log_softmax(logits[..., :v].double() / temperature, dim=-1)
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    out[:, 1:] = logp_all[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return out


def test_sequence_logprobs_alignment_temperature_and_padding() -> None:
    logits, tokens, _, _, _, v = _problem()
    logp, ent = sequence_logprobs_and_entropy(logits, tokens, temperature=0.6, vocab_size=v, logprob_fn=REF)
    torch.testing.assert_close(logp.double(), _oracle_logp(logits, tokens, v, 0.6), rtol=1e-5, atol=1e-5)
    assert logp.dtype == torch.float32 and torch.all(logp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    assert torch.all(ent[:, 1:] > 0) and torch.all(ent <= torch.log(torch.tensor(float(v))) + 1e-5)
    with pytest.raises(ValueError, match=r"\[B, S, V_local\]"):
        sequence_logprobs_and_entropy(logits[0], tokens, logprob_fn=REF)


def test_loss_func_matches_policy_loss_and_undoes_megatron_scaling() -> None:
    logits, tokens, mask, old, adv, v = _problem()
    loss_cfg = DAPOConfig(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    denom = local_loss_denominator(mask)
    x = logits.clone().requires_grad_(True)
    fn = dapo_loss_func(tokens, mask, old, adv, num_tokens=denom, loss=loss_cfg, temperature=0.6, vocab_size=v,
                        num_microbatches=4, dp_size=2, logprob_fn=REF)  # fmt: skip
    loss, metrics = fn(x)
    logp = _oracle_logp(logits, tokens, v, 0.6).float()
    ref, ref_metrics = dapo_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, ref * 8, rtol=1e-5, atol=1e-6)  # x num_microbatches x dp_size
    num, den = metrics["loss"]
    torch.testing.assert_close(num / den, ref, rtol=1e-5, atol=1e-6)
    for key in ("clipfrac_high", "clipfrac_low", "approx_kl"):
        torch.testing.assert_close(metrics[key][0] / metrics[key][1], ref_metrics[key], rtol=1e-4, atol=1e-6)
    assert float(metrics["ratio_max"]) == pytest.approx(float(ref_metrics["ratio_max"]), rel=1e-4)
    assert "entropy" in metrics
    loss.backward()
    assert torch.all(x.grad[..., v:] == 0), "padded vocab columns must get no gradient"
    # [B, S] log-prob input: same loss, no entropy metric.
    loss2, metrics2 = fn(logp)
    torch.testing.assert_close(loss2, loss.detach(), rtol=1e-5, atol=1e-6)
    assert "entropy" not in metrics2
    with pytest.raises(ValueError, match="output must be"):
        fn(logp[:, :-1])


def test_micro_batch_split_gives_the_whole_batch_gradient() -> None:
    """Summing micro-batch gradients with the global D equals the gradient of the whole-batch token mean."""
    logits, tokens, mask, old, adv, v = _problem(b=8)
    full = logits.clone().requires_grad_(True)
    whole = dapo_loss_func(tokens, mask, old, adv, num_tokens=local_loss_denominator(mask), vocab_size=v,
                           logprob_fn=REF)  # fmt: skip
    whole(full)[0].backward()
    split = logits.clone().requires_grad_(True)
    d = sum(local_loss_denominator(mask[i : i + 2]) for i in range(0, 8, 2))
    for i in range(0, 8, 2):
        rows = slice(i, i + 2)
        fn = dapo_loss_func(tokens[rows], mask[rows], old[rows], adv[rows], num_tokens=d, vocab_size=v,
                            num_microbatches=4, logprob_fn=REF)  # fmt: skip
        (fn(split[rows])[0] / 4).backward()  # what megatron's schedule does with the returned loss
    torch.testing.assert_close(split.grad, full.grad, rtol=1e-5, atol=1e-8)


def test_sequence_denominator_for_seq_mean_aggregation() -> None:
    mask = torch.tensor([[0.0, 1, 1], [0, 0, 0], [1, 0, 1]])
    assert float(local_loss_denominator(mask, "token-mean")) == 4.0
    assert float(local_loss_denominator(mask, "seq-mean-token-mean")) == 2.0


def test_dapo_args_are_generated_from_the_dataclass() -> None:
    parser = add_dapo_args(argparse.ArgumentParser())
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    for f in dataclasses.fields(AlgorithmConfig):
        assert f"--dapo-{f.name.replace('_', '-')}" in flags
    for entry in POLICY_LOSSES.values():  # every loss's own fields, as --dapo-loss-<field>
        for f in dataclasses.fields(entry.config_cls):
            assert f"--dapo-loss-{f.name.replace('_', '-')}" in flags
    args = parser.parse_args(
        ["--dapo-loss-eps-low", "0.1", "--dapo-loss-clip-ratio-c", "3", "--dapo-loss-clip-higher", "false"]
        + ["--dapo-group-size", "8"]
    )
    assert dapo_config_from_args(args).group_size == 8
    cfg = dapo_loss_config_from_args(args)
    assert (cfg.eps_low, cfg.clip_ratio_c, cfg.clip_higher) == (0.1, 3.0, False)
    assert cfg.effective_eps_high == 0.1 and cfg.eps_high == DAPOConfig().eps_high
    assert dapo_loss_config_from_args(parser.parse_args(["--dapo-loss-clip-ratio-c", "none"])).clip_ratio_c is None
    assert dapo_config_from_args(parser.parse_args([])) == AlgorithmConfig()
    assert dapo_loss_config_from_args(parser.parse_args([])) == DAPOConfig()
    with pytest.raises(ConfigError, match="--dapo-loss-eps-high"):
        dapo_loss_config_from_args(parser.parse_args(["--dapo-loss-eps-high", "0.05"]))
    # another loss: its own defaults, its norm constant resolved from the generation cap
    dr = dapo_loss_config_from_args(parser.parse_args(["--dapo-policy-loss", "dr_grpo"]), max_response_length=64)
    assert dr == DrGRPOConfig(norm_length=64)
    with pytest.raises(ConfigError, match="--dapo-loss-clip-ratio-c: not a field of policy loss 'gspo'"):
        dapo_loss_config_from_args(parser.parse_args(["--dapo-policy-loss", "gspo", "--dapo-loss-clip-ratio-c", "3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--dapo-overlong-filtering", "maybe"])
    assert "Clip-Higher" in parser.format_help()


def test_integration_example_runs_under_torchrun() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: plain CPU torch path of the ops
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(REPO / "examples" / "integration_example.py"), "--steps", "3"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        out, err = proc.communicate()
        pytest.fail(f"integration example timed out; stderr tail:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-4000:]
    assert "step 2:" in out and "DAPO loss decreased" in out, out[-2000:]
