"""Resuming a run: which checkpoint, whether it may be used, and loading it (falling back past a corrupt one).

    Resume(ckpt, config, rank, world, log)
      .find(inputs)          checkpoint.resume: "auto" (the newest checkpoint that verifies; also on a restarted
                             attempt, whatever the setting: megatron_dapo/restarts.py), "never", or a path (verified,
                             one line naming what is wrong); then `check`
      .check(path, inputs)   the config compatible, the trainer state and this rank's RNG file well formed, the data
                             and the model the ones the checkpoint was trained on (one CheckpointError each)
      .load(path, load_actor)  the checkpoint's trainer state after the actor's files are loaded; a checkpoint whose
                             tensor bytes fail their hashes gives way to the newest earlier one that verifies, when
                             `find` chose it by "auto"
    trainer_state(...)       what a checkpoint holds besides the actor's files

Every check reads files only and raises CheckpointError with one line; the trainer runs them inside its start-up
agreement (launch.agree), so a bad checkpoint is the same one line on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.actor.checkpointing import RNG_KEYS
from megatron_dapo.actor.checkpointing import is_rng_state
from megatron_dapo.actor.checkpointing import rng_file_name
from megatron_dapo.checkpoint import CheckpointError
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.checkpoint import step_of
from megatron_dapo.config import RunConfig
from megatron_dapo.restarts import attempt_number

ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
"""config.json fields that decide the model's tensors: a checkpoint resumes only onto the same values."""


def model_architecture(hf_config: Any) -> dict[str, Any]:
    """The ARCHITECTURE_KEYS of a Hugging Face config that it has (plain values, for a weights_only checkpoint)."""
    return {k: getattr(hf_config, k) for k in ARCHITECTURE_KEYS if getattr(hf_config, k, None) is not None}


def check_architecture(saved: dict[str, Any] | None, current: dict[str, Any], where: str) -> None:
    """CheckpointError naming every architecture field of actor.model_path that differs from the checkpoint's (the
    model directory was replaced at the same path); None (a checkpoint from before this check): nothing to compare."""
    if saved is None:
        return
    changed = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in ARCHITECTURE_KEYS if saved.get(k) != current.get(k)
    ]
    if changed:
        raise CheckpointError(
            f"{where}: cannot resume, the model at actor.model_path is not the one this checkpoint was trained from "
            f"({'; '.join(changed)}); point actor.model_path at that model, or use a new trainer.run_dir"
        )


def _load_state_file(file: Path) -> Any:
    """A small pickle of a checkpoint through torch's weights-only loader (tensors and plain containers: a crafted
    file runs nothing); CheckpointError naming the file when it cannot be read."""
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:  # UnpicklingError (a forbidden global), RuntimeError (a damaged archive)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: refused to load it ({first[:200]})") from None


def check_state_files(path: Path, rank: int, world: int) -> dict[str, Any]:
    """The trainer state of checkpoint `path`, after loading it and this rank's RNG file (the actor's) and checking
    their shape: a crafted, damaged or mismatched file (another step's state, another run's) is one CheckpointError
    naming it, at start-up on every rank, not a traceback in the middle of the actor's load."""
    file = path / "trainer_state.pt"
    state = _load_state_file(file)
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("data"), dict)):
        raise CheckpointError(f"{file}: not a trainer state (expected a dict with step and data)")
    updates = state.get("run_updates")
    if updates is not None and not (isinstance(updates, int) and not isinstance(updates, bool) and updates >= 0):
        raise CheckpointError(f"{file}: run_updates is {updates!r}, not a count")
    name = path.name
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != state["step"]:
        raise CheckpointError(f"{file}: holds step {state['step']}, but it sits in {name} (copied from another one?)")
    rng = path / "actor" / rng_file_name(rank, world)
    if rng.exists() and not is_rng_state(_load_state_file(rng)):
        raise CheckpointError(f"{rng}: not an RNG state (expected {', '.join(RNG_KEYS)})")
    return state


def trainer_state(
    step: int, data: dict[str, Any], carry: list[dict[str, Any]], metrics: dict[str, Any] | None, architecture: dict,
    run_updates: int | None,
) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint holds besides the actor: step, data position (PromptIterator.state_dict), the carried groups
    in full (rollout.partial), this step's metrics row (written back into metrics.jsonl on resume when the file lost
    it: a torn last line), the model's architecture (`model_architecture`) and the optimizer updates the run applied
    up to this step (None: unknown, a run resumed from a checkpoint that predates the count)."""
    return {
        "step": step, "data": data, "carry": carry, "metrics": metrics, "architecture": architecture,
        "run_updates": run_updates,
    }  # fmt: skip


class Resume:
    """The resume decisions of one rank (see the module docstring); `inputs` is the run's RunInputs (data position
    checks and the model's architecture)."""

    def __init__(
        self, ckpt: CheckpointManager, config: RunConfig, rank: int, world: int, log: Callable[[str], None]
    ) -> None:
        self.ckpt, self.config, self.rank, self.world, self.log = ckpt, config, rank, world, log
        self.fall_back = False
        """A checkpoint that fails while loading gives way to the previous one (it was found by "auto")."""

    def find(self, inputs: Any) -> Path | None:
        """The checkpoint to resume from (verified, config compatible) or None; CheckpointError names a bad one."""
        resume = self.config.checkpoint.resume
        restarted = attempt_number() > 0 and resume != "auto" and self.ckpt.find_resumable() is not None
        if restarted:  # a restart continues this job from its own last save (megatron_dapo/restarts.py)
            self.log(f"restart: resuming this job's own last checkpoint (instead of checkpoint.resume={resume})")
            resume = "auto"
        self.fall_back = resume == "auto"
        if resume == "never":
            return None
        if resume == "auto":
            path = self.ckpt.find_resumable()
        else:
            problems = self.ckpt.verify(resume)
            if problems:
                raise CheckpointError(f"checkpoint.resume={resume}: cannot use it: {'; '.join(problems[:3])}")
            path = Path(resume)
        if path is not None:
            self.check(path, inputs)
        return path

    def check(self, path: Path, inputs: Any) -> None:
        """What a resume from `path` needs besides its files: the config compatible, the data and the model the same
        (one line each, every rank)."""
        self.ckpt.check_config(path, self.config.to_dict(), moe=getattr(inputs, "moe", False))
        saved = check_state_files(path, self.rank, self.world)
        inputs.train_data.check_state(saved.get("data", {}), where=str(path), log=self.log)
        check_architecture(saved.get("architecture"), inputs.architecture, str(path))

    def load(self, path: Path, load_actor: Callable[[Path, Any], None], inputs: Any) -> tuple[Path, dict[str, Any]]:
        """Load `path` (load_actor(actor dir, item hashes) reads the actor's files) or, when its tensor bytes fail
        their hashes and `find` chose it by "auto", the newest earlier checkpoint that verifies. Returns (the
        checkpoint loaded, its trainer state)."""
        from megatron_dapo.actor.verified_load import CorruptItem

        while True:
            try:
                state = self.ckpt.load(path, self.config.to_dict(), load_actor)
                break
            except CorruptItem as err:
                if not self.fall_back:  # checkpoint.resume named this one
                    raise CheckpointError(str(err)) from None
                older = self.ckpt.find_resumable(before=step_of(path))
                if older is None:
                    raise CheckpointError(f"{err}; no earlier checkpoint to fall back to") from None
                self.log(f"checkpoint {path} is corrupt: {err}; trying the previous one")
                self.check(older, inputs)
                path = older
        if state.get("sampler"):
            raise CheckpointError(
                f"{path}: saved before the rollout stream with dynamic-sampling carry-over (algorithm.keep_surplus); "
                "its carried groups cannot be resumed: start from another checkpoint or checkpoint.resume=never"
            )
        return path, state


def run_checkpoints(
    config: RunConfig, rank: int, world: int, *, barrier: Callable[[], None], gather: Callable, log: Callable
) -> CheckpointManager:
    """The run's checkpoints (collective over every rank: barrier over the job, gather of one object per rank): the
    actor's files checked for pickles that would run code and hashed item by item (actor/checkpointing.py)."""
    from megatron_dapo.actor.checkpointing import check_checkpoint
    from megatron_dapo.actor.checkpointing import checkpoint_items
    from megatron_dapo.checkpoint import checkpoint_root

    return CheckpointManager(
        checkpoint_root(config.trainer.run_dir),
        config.checkpoint.keep_last,
        rank,
        barrier,
        world_size=world,
        gather=gather,
        log=log,
        allow_unverified=config.checkpoint.allow_unverified,
        check_pickles=lambda path: check_checkpoint(path / "actor"),
        layout=lambda path: {f"actor/{k}": v for k, v in checkpoint_items(path / "actor").items()},
    )
