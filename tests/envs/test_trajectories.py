"""The per-step trajectory samples (logging.trajectory_samples): a jsonl of model turns and observations in order,
and an HTML page a person can open, escaped."""

from __future__ import annotations

import json

import torch

from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import RolloutGroup
from megatron_dapo.trajectories import response_parts
from megatron_dapo.trajectories import sample_records
from megatron_dapo.trajectories import write_samples


def _group(tok, index: int) -> RolloutGroup:
    enc = lambda text: tok.encode(text, add_special_tokens=False)
    prompt = enc("What is 12 * 34?")
    first, obs, last = enc("<script>alert(1)</script> calling"), enc("[tool] 408"), enc("Answer: 408")
    trajectory = Rollout(prompt, first, None, FinishReason.STOP, ((0, 0),)).observe(obs, 0).extend(last, None, 0)
    trajectory.finish = FinishReason.STOP
    plain = Rollout(prompt, enc("Answer: 7"), None, FinishReason.LENGTH)
    episodes = {"turns": torch.tensor([2.0, 1.0]), "stop/answer": torch.tensor([1.0, 0.0])}
    accs, rewards = torch.tensor([True, False]), torch.tensor([1.0, -1.0])
    return RolloutGroup(index, index, "408", [trajectory, plain], accs, rewards, torch.zeros(2), episodes=episodes)


def test_samples_show_turns_and_observations_in_order(byte_tokenizer, tmp_path):
    groups = [_group(byte_tokenizer, 3), _group(byte_tokenizer, 4)]
    assert [role for role, _ in response_parts(groups[0].rollouts[0])] == ["model", "observation", "model"]
    path = write_samples(tmp_path, 7, sample_records(groups, byte_tokenizer, 3))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    # One response per group in turn: example 3's first, example 4's first, then example 3's second.
    assert [(r["index"], r["sample"]) for r in records] == [(3, 0), (4, 0), (3, 1)]
    first = records[0]
    assert [p["role"] for p in first["parts"]] == ["model", "observation", "model"]
    assert [p["text"] for p in first["parts"]] == ["<script>alert(1)</script> calling", "[tool] 408", "Answer: 408"]
    assert first["reward"] == 1.0 and first["acc"] and first["episode"]["turns"] == 2.0
    assert first["model_tokens"] == first["tokens"] - len("[tool] 408")
    assert records[2]["finish"] == "length" and records[2]["parts"] == [{"role": "model", "text": "Answer: 7"}]
    write_samples(tmp_path, 8, sample_records(groups[:1], byte_tokenizer, 1))
    page = (tmp_path / "trajectories" / "index.html").read_text()
    assert page.index("step_00000008") < page.index("step_00000007")  # newest first
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("class='observation'") == 3  # one per multi-turn response shown
