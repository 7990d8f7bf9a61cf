"""The records that travel from a rollout engine to the trainer: `Rollout`, `RolloutGroup`, `GroupSummary`.

    GenerationRequest --engine--> Rollout (one response: tokens, engine log-probs, finish, weight-version segments)
    G Rollouts of one prompt --score--> RolloutGroup (prompt index, rollouts, rewards, accs) on the generating rank
    RolloutGroup.summary(owner) --> GroupSummary (no tokens): what every rank needs for dynamic sampling, advantages,
                                   metrics and the row plan; the token rows stay with their owner until routed

No string-keyed payloads: a field read later is a field here. Checkpoints are `weights_only` (plain containers and
tensors), so each record has `to_state()` / `from_state()` and nothing else pickles them into a checkpoint.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch
from torch import Tensor

from megatron_dapo import wire


@wire.record
class FinishReason(enum.Enum):
    """Why a response ended. STOP: a stop/EOS token was generated (and is the last token); LENGTH: the generation
    cap was reached (exactly max_new_tokens tokens); ABORT: the engine stopped it (the step reached its target and
    rollout.partial is off, or the response is carried to the next step and is not finished yet)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def finished(self) -> bool:
        """True for STOP and LENGTH: the response is complete and can be scored."""
        return self is not FinishReason.ABORT


def _ids(values: Sequence[int] | Tensor) -> Tensor:
    return torch.as_tensor(values, dtype=torch.int32).reshape(-1).cpu()


def _logps(values: Sequence[float] | Tensor | None) -> Tensor | None:
    return None if values is None else torch.as_tensor(values, dtype=torch.float32).reshape(-1).cpu()


@wire.record
@dataclass(slots=True, eq=False)
class Rollout:
    """One sampled response (possibly unfinished: finish ABORT).

    prompt_ids: [P] int32, the prompt as given to the engine.
    response_ids: [L] int32, generated tokens, the stop token included when finish is STOP.
    engine_logp: [L] fp32 or None; log_softmax(logits / T)[token] under the weights that generated each token
        (the tempered full-vocabulary distribution, before top-k/top-p), None when not requested.
    finish: FinishReason.
    segments: ((start, version), ...) in increasing start, first start 0: tokens [start_i, start_{i+1}) were generated
        with weight version `version` (the trainer step whose sync produced the weights; a response carried over a
        step boundary by partial rollouts has two or more segments). Empty for a response with no token yet.
    routed_experts: [N, moe_layers, k] uint8 / int16 or None (SamplingParams.return_routed_experts, MoE models):
        the experts the engine routed each token of prompt + response to, positions 0..N-1 (N = P + L - 1: the last
        token is never fed back). A continued response carries the latest run's, which re-read the whole context.
    observations: ((start, end), ...) in increasing order: response tokens [start, end) were not sampled by the model
        but appended by a multi-turn environment (a tool's output in the chat format, envs/); their engine_logp is 0
        and they are masked out of the loss and the log-prob metrics. Empty for a single-turn response.
    episode: a multi-turn environment's record of this trajectory, plain values: {"outcome": {"reward", "details"}}
        once it ended (what the group scorer uses), {"state": ...} on an unfinished trajectory carried across steps
        (its episode's state after its last complete turn, restored when it continues); None otherwise. A
        continuation (`extend`, `observe`) starts without one.
    """

    prompt_ids: Tensor
    response_ids: Tensor
    engine_logp: Tensor | None
    finish: FinishReason
    segments: tuple[tuple[int, int], ...] = ()
    routed_experts: Tensor | None = None
    observations: tuple[tuple[int, int], ...] = ()
    episode: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = _ids(self.prompt_ids)
        self.response_ids = _ids(self.response_ids)
        self.engine_logp = _logps(self.engine_logp)
        if not isinstance(self.finish, FinishReason):
            self.finish = FinishReason(self.finish)
        if self.engine_logp is not None and self.engine_logp.numel() != self.response_ids.numel():
            raise ValueError(
                f"Rollout.engine_logp: {self.engine_logp.numel()} values for {self.response_ids.numel()} tokens"
            )
        if self.routed_experts is not None and len(self.routed_experts) > len(self.prompt_ids) + len(self):
            raise ValueError(
                f"Rollout.routed_experts: {len(self.routed_experts)} positions for {len(self.prompt_ids)} prompt + "
                f"{len(self)} response tokens"
            )
        self.segments = tuple((int(s), int(v)) for s, v in self.segments)
        starts = [s for s, _ in self.segments]
        if starts and (starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] > len(self)):
            raise ValueError(f"Rollout.segments: starts must be 0 < ... <= {len(self)}, got {starts}")
        self.observations = tuple((int(a), int(b)) for a, b in self.observations)
        bounds = [x for span in self.observations for x in span]
        if bounds and (bounds != sorted(bounds) or bounds[-1] > len(self) or any(a >= b for a, b in self.observations)):
            raise ValueError(f"Rollout.observations: spans must be ordered, non-empty and <= {len(self)}: {bounds}")

    def __len__(self) -> int:
        """Generated tokens, the stop token included."""
        return int(self.response_ids.numel())

    @property
    def model_tokens(self) -> int:
        """Response tokens the model sampled (observation tokens excluded)."""
        return len(self) - sum(b - a for a, b in self.observations)

    @property
    def turn_start(self) -> int:
        """Where the model's current (last) turn starts: after the last observation (0 without one)."""
        return self.observations[-1][1] if self.observations else 0

    def model_mask(self) -> Tensor:
        """[L] bool: True on the tokens the model sampled, False on observation tokens."""
        mask = torch.ones(len(self), dtype=torch.bool)
        for a, b in self.observations:
            mask[a:b] = False
        return mask

    def observe(self, ids: Sequence[int] | Tensor, version: int) -> Rollout:
        """This trajectory with an environment's observation tokens `ids` appended (engine log-prob 0, not trained
        on), stamped with weight `version` like a continuation; finish ABORT (the model's next turn follows)."""
        ids_t = _ids(ids)
        logps = None if self.engine_logp is None else torch.zeros(ids_t.numel())
        out = self.extend(ids_t, logps, version)
        if ids_t.numel():
            out.observations = (*self.observations, (len(self), len(out)))
        return out

    @property
    def oldest_version(self) -> int | None:
        """Weight version of the first segment (None before the first token)."""
        return self.segments[0][1] if self.segments else None

    def extend(
        self,
        ids: Sequence[int] | Tensor,
        logps: Sequence[float] | Tensor | None,
        version: int,
        routed_experts: Tensor | None = None,
    ) -> Rollout:
        """This response continued by `ids` (engine log-probs `logps`) generated under weight `version`; a new
        segment starts unless the version is the last one's. Finish is left ABORT (the caller sets it).
        routed_experts: the continuing run's routing of the whole sequence (replaces this one's), or None."""
        ids_t = _ids(ids)
        segments = self.segments
        if ids_t.numel() and (not segments or segments[-1][1] != version):
            segments = (*segments, (len(self), int(version)))
        logp = None
        if self.engine_logp is not None and logps is not None:
            logp = torch.cat([self.engine_logp, _logps(logps)])
        routed = routed_experts if routed_experts is not None else self.routed_experts
        response = torch.cat([self.response_ids, ids_t])
        return Rollout(self.prompt_ids, response, logp, FinishReason.ABORT, segments, routed, self.observations)

    def routing_layers(self, layers: tuple[int, int] | None) -> Rollout:
        """This response with only MoE layers [first, first + count) of its routed_experts (what one pipeline stage
        replays), `layers` = (first, count); itself when there is nothing to cut (no routing, layers None, or the
        slice is every layer)."""
        routed = self.routed_experts
        if routed is None or layers is None or (layers[0] == 0 and layers[1] == routed.shape[1]):
            return self
        first, count = layers
        if first < 0 or count < 1 or first + count > routed.shape[1]:
            raise ValueError(f"Rollout.routing_layers: layers {first}..{first + count - 1} of {routed.shape[1]}")
        sliced = routed[:, first : first + count].contiguous()
        return Rollout(
            self.prompt_ids,
            self.response_ids,
            self.engine_logp,
            self.finish,
            self.segments,
            sliced,
            self.observations,
            self.episode,
        )

    def to_state(self) -> dict[str, Any]:
        """Plain containers and tensors (weights_only checkpoints)."""
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "engine_logp": self.engine_logp,
            "finish": self.finish.value,
            "segments": [list(s) for s in self.segments],
            "routed_experts": self.routed_experts,
            "observations": [list(s) for s in self.observations],
            "episode": self.episode,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollout:
        return cls(
            state["prompt_ids"],
            state["response_ids"],
            state["engine_logp"],
            FinishReason(state["finish"]),
            tuple(tuple(s) for s in state["segments"]),
            state.get("routed_experts"),
            tuple(tuple(s) for s in state.get("observations", ())),
            state.get("episode"),
        )


@dataclass(slots=True, eq=False)
class GenerationRequest:
    """One response for an engine to generate (or continue).

    key: the caller's id, returned with the result (the stream uses (queue position, sample)).
    prompt_ids: [P] int32.
    seed: the generator seed of this response in this step (`completion_seed(base, prompt index, sample)`).
    prefix: an unfinished Rollout of this request to continue (partial rollouts), or None to start afresh. The cap
        (SamplingParams.max_new_tokens) counts the prefix's tokens: the continuation generates at most cap - len.
    """

    key: Any
    prompt_ids: Tensor
    seed: int
    prefix: Rollout | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = _ids(self.prompt_ids)
        if self.prompt_ids.numel() == 0:
            raise ValueError(f"GenerationRequest {self.key!r}: the prompt is empty")


@wire.record
@dataclass(slots=True, eq=False)
class RolloutGroup:
    """One prompt with its G scored responses, on the rank that generated them.

    index: the prompt's example index in the training data (its identity: seeds and logs use it).
    position: its place in the step's prompt queue (dynamic sampling decides groups in this order).
    truth: the ground-truth answer the rewards were scored against.
    rollouts: G finished Rollouts of the same prompt.
    accs: [G] bool, the verifier's correctness (dynamic sampling admits on it, never on the shaped reward).
    rewards: [G] fp32, +1/-1 plus the overlong penalty.
    penalties: [G] fp32, the overlong penalty alone (0 without it).
    episodes: a multi-turn environment's per-response counts, name -> [G] fp32 (envs.base.EPISODE_COUNTS and
        observation_tokens); empty for single-turn responses.
    """

    index: int
    position: int
    truth: str
    rollouts: list[Rollout]
    accs: Tensor
    rewards: Tensor
    penalties: Tensor
    episodes: dict[str, Tensor] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> Tensor:
        return self.rollouts[0].prompt_ids

    def summary(self, owner: int, key: str) -> GroupSummary:
        """The token-free record every rank receives; `owner` is the rank that keeps this group's rows under `key`."""
        return GroupSummary(
            index=self.index,
            position=self.position,
            owner=int(owner),
            key=str(key),
            prompt_len=int(self.prompt_ids.numel()),
            accs=self.accs,
            rewards=self.rewards,
            penalties=self.penalties,
            lengths=torch.tensor([len(r) for r in self.rollouts], dtype=torch.int64),
            finish=tuple(r.finish for r in self.rollouts),
            oldest_versions=tuple(r.oldest_version if r.oldest_version is not None else -1 for r in self.rollouts),
            episodes=dict(self.episodes),
        )

    def to_state(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "position": self.position,
            "truth": self.truth,
            "rollouts": [r.to_state() for r in self.rollouts],
            "accs": self.accs,
            "rewards": self.rewards,
            "penalties": self.penalties,
            "episodes": dict(self.episodes),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RolloutGroup:
        return cls(
            index=int(state["index"]),
            position=int(state["position"]),
            truth=str(state["truth"]),
            rollouts=[Rollout.from_state(r) for r in state["rollouts"]],
            accs=state["accs"],
            rewards=state["rewards"],
            penalties=state["penalties"],
            episodes=dict(state.get("episodes", {})),
        )


@wire.record
@dataclass(slots=True, eq=False)
class GroupSummary:
    """A scored group without its tokens (every rank receives it; the sampler, advantages, metrics and the row plan
    read only this). Fields as in RolloutGroup, plus owner and key (the rank holding the rows, and their key there),
    prompt_len, lengths [G] int64 (response tokens, EOS and observation tokens included), finish (G FinishReasons)
    and oldest_versions (G ints: the weight version of each response's first token)."""

    index: int
    position: int
    owner: int
    key: str
    prompt_len: int
    accs: Tensor
    rewards: Tensor
    penalties: Tensor
    lengths: Tensor
    finish: tuple[FinishReason, ...]
    oldest_versions: tuple[int, ...] = field(default=())
    dropped: bool = False
    """The group was given up: its prompt hit rollout.prompt_retries engine failures (no responses; never kept)."""
    episodes: dict[str, Tensor] = field(default_factory=dict)
    """RolloutGroup.episodes: a multi-turn environment's per-response counts (empty for single-turn responses)."""

    @classmethod
    def given_up(cls, index: int, position: int, owner: int, key: str, prompt_len: int) -> GroupSummary:
        """The summary of a group given up after engine failures: decided (its queue position is passed) but empty."""
        empty = torch.zeros(0)
        return cls(
            index, position, owner, key, prompt_len, torch.zeros(0, dtype=torch.bool), empty, empty,
            torch.zeros(0, dtype=torch.int64), (), dropped=True,
        )  # fmt: skip

    @property
    def group_size(self) -> int:
        return int(self.lengths.numel())
