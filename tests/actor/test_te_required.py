"""On CUDA without Transformer Engine the actor stops with a one-line error unless the local spec is allowed.

No GPU here: TE availability is monkeypatched and the GPU path is taken through on_cpu=False.
"""

from __future__ import annotations

import pytest

from megatron_dapo.actor import model
from megatron_dapo.config import ActorConfig
from megatron_dapo.config import load_config
from tests.actor.test_model_logits import _hf_config


def test_gpu_without_te_stops_with_the_fix_named(monkeypatch):
    monkeypatch.setattr(model, "_have_te", lambda: False)
    with pytest.raises(RuntimeError, match=r"^actor: Transformer Engine is not importable") as info:
        model.to_transformer_config(_hf_config(), ActorConfig(dtype="bf16"), on_cpu=False)
    msg = str(info.value)
    assert "\n" not in msg and "pip install -e .[te]" in msg and "actor.allow_local_spec_on_gpu=true" in msg


def test_switch_allows_the_local_spec_on_gpu(monkeypatch):
    monkeypatch.setattr(model, "_have_te", lambda: False)
    cfg = model.to_transformer_config(
        _hf_config(), ActorConfig(dtype="bf16", allow_local_spec_on_gpu=True), on_cpu=False
    )
    assert cfg.bf16 and not cfg.apply_rope_fusion  # GPU settings, no TE fusion
    debug = ActorConfig(dtype="bf16", tensor_parallel=2, allow_local_spec_on_gpu=True)
    assert not model.to_transformer_config(_hf_config(), debug, on_cpu=False).sequence_parallel  # no local SP norm
    assert not model.use_transformer_engine(ActorConfig(allow_local_spec_on_gpu=True), on_cpu=False)


def test_te_present_or_cpu_never_stops(monkeypatch):
    monkeypatch.setattr(model, "_have_te", lambda: True)
    assert model.use_transformer_engine(ActorConfig(), on_cpu=False)
    monkeypatch.setattr(model, "_have_te", lambda: False)
    assert not model.use_transformer_engine(ActorConfig(), on_cpu=True)


def test_switch_is_a_config_field():
    assert load_config(None, ["--actor.allow_local_spec_on_gpu=true"]).actor.allow_local_spec_on_gpu
    assert not ActorConfig().allow_local_spec_on_gpu
