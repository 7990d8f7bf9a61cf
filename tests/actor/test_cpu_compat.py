"""cpu_compat: explicit, idempotent, never applied at import, refuses to act with CUDA, enables TP=2 on CPU."""

from __future__ import annotations

import torch

from megatron_dapo.actor import cpu_compat
from tests.actor._actor_checks import cached_results


def test_not_applied_at_import_then_applied_once():
    for rank, res in enumerate(cached_results(2)):
        # The worker imported every megatron_dapo.actor module before init_distributed.
        assert res["before_init"]["applied"] is False, rank
        assert res["after_init"]["applied"] is True, rank
        assert res["after_init"]["synchronize"] != res["before_init"]["synchronize"], rank
        # A second apply_cpu_compat() changes nothing.
        assert res["after_second_apply"] == res["after_init"], rank


def test_enables_tp2_forward_on_cpu():
    results = cached_results(2)
    for res in results:
        logits = res["tp2/llama"]["logits"]
        assert logits is not None and logits.shape == (2, 11, 200)
        assert torch.isfinite(logits).all()
    assert torch.equal(results[0]["tp2/llama"]["logits"], results[1]["tp2/llama"]["logits"])


def test_activation_recompute_on_cpu():
    # Full recompute replays the forward with restored RNG states; gradients must match the plain run.
    for res in cached_results(2):
        assert res["tp2/recompute_grad_err"] <= 1e-6


def test_noop_when_cuda_available(monkeypatch):
    if cpu_compat.cpu_compat_applied():  # another test in this process applied it: nothing to check here
        return
    before = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_compat.apply_cpu_compat()
    assert not cpu_compat.cpu_compat_applied()
    assert torch.cuda.synchronize is before


def test_cuda_to_cpu_mode_and_stand_in_torch():
    with cpu_compat._CudaToCpuMode():
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"
    stand_in = cpu_compat._CpuDeviceTorch()
    assert stand_in.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert stand_in.tensor([1.0], device="cuda:0").device.type == "cpu"
    assert stand_in.Tensor is torch.Tensor and stand_in.float32 is torch.float32
