"""Tests build RolloutStreams from keyword settings: the StreamHooks fields go to the hooks, the rest to the config."""

from dataclasses import fields

from megatron_dapo.rollout.stream import RolloutStream
from megatron_dapo.rollout.stream import StreamConfig
from megatron_dapo.rollout.stream import StreamHooks

_HOOKS = {f.name for f in fields(StreamHooks)}


def make_stream(engine, rank, exchange, store, **settings) -> RolloutStream:
    hooks = {k: settings.pop(k) for k in list(settings) if k in _HOOKS}
    return RolloutStream(engine, rank, exchange, store, StreamConfig(**settings), StreamHooks(**hooks))
