"""The actor's checkpoint files, a component beside MegatronActor (which keeps `save_checkpoint` / `load_checkpoint`
as its public face and calls this).

    <dir>/                             megatron dist_checkpointing: model, optimizer ("dp_reshardable" sharding),
                                       {"actor": {"num_steps"}}
    <dir>/rng_rank{rank:05d}_of{world}.pt   this rank's RNG states (python, torch, megatron's tracker, cuda)

`rng_file_name` is the one place the RNG file is named (the trainer's resume checks read it too, resume.py);
`check_checkpoint` and `checkpoint_items` read files only (no collective). megatron is imported where it is used, so
the names above can be read without it.

Optimizer state (torch Adam, used when neither TE nor Apex is installed): megatron's save needs Adam's state to exist
before the first step (`allocate_adam_state`), and its load can leave one shared `step` tensor for every parameter
(`restore_adam_steps` rebuilds them from the step count).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from megatron_dapo.actor.background_save import BackgroundWrite
    from megatron_dapo.checkpoint import ItemHashes

RNG_KEYS = ("torch", "python", "tracker")
"""Keys every RNG file holds ("cuda" too when saved on a GPU)."""


def rng_file_name(rank: int, world_size: int) -> str:
    """The RNG file of global rank `rank` in a job of `world_size` ranks (restored only with the same world)."""
    return f"rng_rank{rank:05d}_of{world_size}.pt"


def is_rng_state(state: Any) -> bool:
    """Whether `state` has the shape of an RNG file's content (RNG_KEYS, a uint8 torch state, a python tuple)."""
    return (
        isinstance(state, dict)
        and all(k in state for k in RNG_KEYS)
        and isinstance(state["torch"], torch.Tensor)
        and state["torch"].dtype == torch.uint8
        and isinstance(state["python"], tuple)
    )


def check_checkpoint(ckpt_dir: str | os.PathLike) -> None:
    """Refuse a directory of `save` that would run code when loaded: CheckpointError, one line naming the file and the
    global, before anything is unpickled (actor/safe_unpickle.py). Local: reads files, no collective."""
    from megatron_dapo.actor.safe_unpickle import check_dist_checkpoint

    check_dist_checkpoint(ckpt_dir)


def checkpoint_items(ckpt_dir: str | os.PathLike) -> dict[str, list[tuple[int, int]]]:
    """{tensor file of a `save` directory: [(offset, length) of each storage item]}: what the checkpoint manifest
    hashes item by item, so a resume checks those bytes as it loads them (verified_load.py)."""
    from megatron_dapo.actor.verified_load import storage_items

    return storage_items(ckpt_dir)


def torch_adam_states(optimizer: Any) -> Iterator[tuple[Tensor, dict[str, Any]]]:
    """(param, state) of the torch Adam / AdamW inside a megatron optimizer (chained or not)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                for p in group["params"]:
                    yield p, inner.state[p]


def allocate_adam_state(optimizer: Any) -> None:
    """What torch Adam creates at its first step (zero moments, step 0), for parameters that have none yet:
    megatron's checkpoint code needs the state allocated."""
    for p, state in torch_adam_states(optimizer):
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def restore_adam_steps(optimizer: Any, num_steps: int) -> None:
    """Set torch Adam's per-parameter `step` to the restored optimizer step count.

    megatron's DistributedOptimizer.load_state_dict (torch-Adam path) gives every parameter the SAME `step` tensor,
    which Adam then increments once per parameter, and it can keep the pre-load value. Adam's step is by construction
    the number of successful optimizer steps (skipped steps never reach it), so it is rebuilt from num_steps, one
    tensor per parameter. It is also set where the load left none: megatron saves the step only when it is non-zero
    (`if step:`), so a checkpoint from before the first step has moments without it."""
    for _, state in torch_adam_states(optimizer):
        if state:
            state["step"] = torch.tensor(float(num_steps), dtype=state["step"].dtype)


class ActorCheckpoint:
    """Saves and loads one MegatronActor's checkpoint directory (collective on every call). The actor is read
    through its public parts: unwrapped(), optimizer, steps (the step count and lr), resident()."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def _sharded_state_dict(self, is_loading: bool, with_optimizer: bool = True) -> dict[str, Any]:
        actor = self.actor
        model_sd = actor.unwrapped().sharded_state_dict()
        state = {"model": model_sd, "actor": {"num_steps": actor.steps.num_steps}}
        if with_optimizer:
            # Before the first step torch Adam has no state: megatron's save asserts on it (distributed optimizer) or
            # writes no moments (plain), and the load then misses them. Allocate what Adam would create.
            allocate_adam_state(actor.optimizer)
            state["optimizer"] = actor.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
        return state

    def save(self, ckpt_dir: str, *, background: bool = False) -> BackgroundWrite | None:
        """Model, optimizer, step count (megatron dist_checkpointing) and this rank's RNG states; see
        MegatronActor.save_checkpoint."""
        from megatron.core import dist_checkpointing

        from megatron_dapo.actor.background_save import BackgroundWrite
        from megatron_dapo.actor.ckpt_writer import install_writer_queue

        os.makedirs(ckpt_dir, exist_ok=True)
        install_writer_queue()  # megatron's writer helper survives preemption signals (actor/ckpt_writer.py)
        dist.barrier()
        pending = None
        with self.actor.resident():
            if background:
                request = dist_checkpointing.save(
                    self._sharded_state_dict(is_loading=False), ckpt_dir, async_sharded_save=True
                )
                pending = BackgroundWrite(request)  # the host copy is taken here, while the state is resident
            else:
                dist_checkpointing.save(self._sharded_state_dict(is_loading=False), ckpt_dir)
        rng = os.path.join(ckpt_dir, rng_file_name(dist.get_rank(), dist.get_world_size()))
        torch.save(_rng_state(), rng)
        dist.barrier()
        return pending

    def load(self, ckpt_dir: str, *, load_optimizer: bool = True, items: ItemHashes | None = None) -> None:
        """What `save` wrote; see MegatronActor.load_checkpoint. Nothing in the checkpoint runs: `check_checkpoint`
        comes first."""
        from megatron.core import dist_checkpointing

        from megatron_dapo.actor.verified_load import load_verified

        actor = self.actor
        check_checkpoint(ckpt_dir)
        with actor.resident():
            sharded = self._sharded_state_dict(is_loading=True, with_optimizer=load_optimizer)
            state = load_verified(lambda: dist_checkpointing.load(sharded, ckpt_dir), items)
            actor.unwrapped().load_state_dict(state["model"])
            if load_optimizer:
                _fill_missing_common_step(state["optimizer"])
                with torch.no_grad():
                    actor.optimizer.load_state_dict(state["optimizer"])
            else:
                actor.optimizer.reload_model_params()
        actor.steps.num_steps = int(state["actor"]["num_steps"])
        if load_optimizer:
            restore_adam_steps(actor.optimizer, actor.steps.num_steps)
        actor.steps.set_lr()
        rng_file = os.path.join(ckpt_dir, rng_file_name(dist.get_rank(), dist.get_world_size()))
        if os.path.exists(rng_file):
            _set_rng_state(_load_rng_file(rng_file))


def _fill_missing_common_step(optimizer_state: Any) -> None:
    """megatron saves Adam's shared step only when it is non-zero (`if step:`), so a checkpoint written before the
    first optimizer step has moments without a step, which torch Adam refuses (KeyError 'step'). Put step 0 back
    (the true value: nothing stepped) in every plain-optimizer state of the loaded dict."""
    if not isinstance(optimizer_state, dict):
        return
    inner = optimizer_state.get("state")
    if isinstance(inner, dict) and "common_step" not in inner:
        params = [v for v in inner.values() if isinstance(v, dict)]
        if params and all("exp_avg" in v and "step" not in v for v in params):
            inner["common_step"] = torch.tensor(0.0)
    for value in optimizer_state.values():
        if isinstance(value, dict) and value is not inner:
            _fill_missing_common_step(value)


def _load_rng_file(path: str) -> dict[str, Any]:
    """The RNG states of `save`, unpickled with torch's weights-only loader: tensors, ints, tuples and dicts only, so
    a crafted file cannot run code (it is refused with its name)."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # UnpicklingError for disallowed globals, RuntimeError for a damaged archive
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: refused to load the RNG state ({first})") from None


def _rng_state() -> dict[str, Any]:
    import random

    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
