"""Deterministic, resumable iterator over prompt batches.

Epoch e visits every example once in the order ``numpy.random.default_rng([seed, e]).permutation(N)`` (or 0..N-1
when shuffle is off). The whole state is (epoch, position): the number of examples of epoch ``epoch`` already
handed out. Saving ``state_dict()`` and loading it into a fresh iterator over the same data continues with exactly
the batches the original would have produced. Built with the data's ``identity`` (PromptDataset.identity), the state
records it, and loading a state saved over other data (a file edited between runs) is refused naming what changed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

import numpy as np

from megatron_dapo.data.identity import identity_change

__all__ = ["PromptIterator"]

T = TypeVar("T")


class PromptIterator:
    """Hands out batches of examples, shuffled per epoch by seed, wrapping across epochs.

    Args:
        examples: any sequence (e.g. a ``PromptDataset``); only ``len`` and indexing are used.
        seed: shuffle seed (DataConfig.seed).
        shuffle: False visits examples in file order every epoch (DataConfig.shuffle).
        identity: the examples' identity (PromptDataset.identity), saved in the state and checked on load.
    """

    def __init__(
        self, examples: Sequence[T], *, seed: int = 0, shuffle: bool = True, identity: dict[str, Any] | None = None
    ):
        if len(examples) == 0:
            raise ValueError("PromptIterator needs at least one example")
        self.examples = examples
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.identity = identity
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Example indices of ``epoch`` in visiting order: int64 [N]."""
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(n).astype(np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = self.epoch_order(epoch)
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n: int) -> list[T]:
        """The next ``n`` examples; continues into the next epoch(s) when the current one runs out."""
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        batch: list[T] = []
        size = len(self.examples)
        while len(batch) < n:
            order = self._order_for(self.epoch)
            take = min(n - len(batch), size - self.position)
            batch.extend(self.examples[int(i)] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == size:
                self.epoch += 1
                self.position = 0
        return batch

    def peek(self, offset: int) -> T:
        """The example `offset` places ahead of the current position (0 = what next_batch(1) would return), without
        moving; continues into later epochs. The rollout stream hands out queue positions this way."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        size = len(self.examples)
        epoch, position = divmod(self.position + offset, size)
        return self.examples[int(self._order_for(self.epoch + epoch)[position])]

    def skip(self, n: int) -> None:
        """Move past the next n examples (the ones a step consumed)."""
        if n < 0:
            raise ValueError(f"skip: n must be >= 0, got {n}")
        epoch, self.position = divmod(self.position + n, len(self.examples))
        self.epoch += epoch

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state for checkpoints: epoch, position, seed, shuffle, num_examples (and identity)."""
        state = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_examples": len(self.examples),
        }
        if self.identity is not None:
            state["identity"] = self.identity
        return state

    def check_state(
        self, state: dict[str, Any], *, where: str = "data iterator state", log: Callable[[str], None] | None = None
    ) -> None:
        """ValueError (one line, starting with `where`) if ``state`` was saved for other data, another shuffle
        setting or is out of range. A state without identity (an older checkpoint) is checked by its row count only,
        said through `log`."""
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"{where} is missing keys {sorted(missing)}")
        way_out = "use a new trainer.run_dir or checkpoint.resume=never"
        if self.identity is not None and "identity" in state:
            change = identity_change(state["identity"], self.identity)
            if change:
                raise ValueError(f"{where}: cannot resume, the training data changed ({change}); {way_out}")
        elif self.identity is not None and log is not None:
            log(f"{where} has no fingerprint of its training data (an older version): checking its row count only")
        for key, mine in (("num_examples", len(self.examples)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"{where} has {key}={state[key]!r} but this iterator has {mine!r}; {way_out}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.examples):
            raise ValueError(f"{where} out of range: epoch={epoch}, position={position}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` after ``check_state``."""
        self.check_state(state)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
