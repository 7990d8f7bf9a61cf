"""Worker run on every gloo rank by the actor tests: build, load, forward and export, for several layouts.

One process launch costs ~15-25 s of imports, so one launch checks every (tensor_parallel, pipeline_parallel)
layout of a given world size and both tiny models; the results are cached per pytest process so
test_model_logits.py and test_hf_weights.py share them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.actor._dist import run_distributed
from tests.actor._tiny_models import every_tiny_checkpoint

LAYOUTS = {2: ((2, 1, 1), (1, 2, 1), (1, 1, 2)), 4: ((2, 2, 1), (2, 1, 2), (1, 2, 2))}
"""(tensor_parallel, pipeline_parallel, expert_parallel) checked per world size."""
DENSE = ("llama", "qwen2", "qwen3")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")


def layout_id(tp: int, pp: int, ep: int) -> str:
    return "x".join(f"{name}{size}" for name, size in (("tp", tp), ("pp", pp), ("ep", ep)) if size > 1)


def case_params() -> list[Any]:
    """pytest params (world, tp, pp, ep, model) of every check: every model at every layout, the MoE ones only under
    EP > 1; the 4-rank launch is marked slow."""
    return [
        pytest.param(
            world, tp, pp, ep, model, id=f"{layout_id(tp, pp, ep)}-{model}", marks=[pytest.mark.slow] * (world > 2)
        )
        for world, layouts in LAYOUTS.items()
        for tp, pp, ep in layouts
        for model in (MOE if ep > 1 else DENSE + MOE)
    ]


def _compat_state() -> dict[str, Any]:
    from megatron_dapo.actor import cpu_compat

    return {"applied": cpu_compat.cpu_compat_applied(), "synchronize": id(torch.cuda.synchronize)}


def actor_checks(ckpts: dict[str, str], tokens: torch.Tensor) -> dict[str, Any]:
    """Per-rank results: cpu_compat facts, and per (tp, pp, model) logits / export checks."""
    import megatron_dapo.actor.distributed
    import megatron_dapo.actor.hf_weights
    import megatron_dapo.actor.model  # noqa: F401
    from megatron_dapo.actor.cpu_compat import apply_cpu_compat
    from megatron_dapo.actor.distributed import destroy_distributed
    from megatron_dapo.actor.distributed import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {"before_init": _compat_state()}
    for tp, pp, ep in LAYOUTS[world]:
        groups = init_distributed(tp, pp, expert_parallel=ep)
        if "after_init" not in out:
            out["after_init"] = _compat_state()
            apply_cpu_compat()
            out["after_second_apply"] = _compat_state()
        for name in MOE if ep > 1 else DENSE + MOE:
            out[f"{layout_id(tp, pp, ep)}/{name}"] = _check_model(Path(ckpts[name]), tokens, groups, tp, pp, ep)
        if pp == 1 and ep == 1:
            grad_err = _recompute_grad_err(Path(ckpts["qwen2"]), tokens, groups, tp)
            out[f"{layout_id(tp, pp, ep)}/recompute_grad_err"] = grad_err
    destroy_distributed()
    return out


def _check_model(hf_dir: Path, tokens: torch.Tensor, groups: Any, tp: int, pp: int, ep: int) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megatron_dapo.actor.hf_weights import export_hf_weights
    from megatron_dapo.actor.hf_weights import load_hf_into_model
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.actor.model import forward_logits
    from megatron_dapo.config import ActorConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    # Qwen2-MoE under EP without PP takes megatron's allgather dispatcher (the rest alltoall).
    dispatcher = "allgather" if ep > 1 and pp == 1 and hf_dir.name == "qwen2_moe" else "alltoall"
    actor_cfg = ActorConfig(
        model_path=str(hf_dir),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        dtype="fp32",
        moe_dispatcher=dispatcher,
    )
    model = build_gpt_model(hf_config, actor_cfg, groups)
    load_hf_into_model([model], hf_dir, hf_config, groups)
    model.eval()  # megatron's MoE layer refuses TP > 1 without sequence parallel (none on CPU) in training mode only
    logits = forward_logits([model], tokens, groups, vocab_size=hf_config.vocab_size)
    original = load_file(str(hf_dir / "model.safetensors"))
    exported = {name: t.clone() for name, t in export_hf_weights([model], hf_config, groups)}
    # A small bucket bound must give the same tensors in the same order.
    small = [(n, t.clone()) for n, t in export_hf_weights([model], hf_config, groups, bucket_bytes=4096)]
    mismatched = sorted(k for k in original if k in exported and not torch.equal(original[k], exported[k]))
    # dst_rank=r: rank r gets exactly the full export, every other rank nothing.
    dst_ok = []
    for dst in range(groups.world_size):
        got = [
            (n, t.clone()) for n, t in export_hf_weights([model], hf_config, groups, bucket_bytes=4096, dst_rank=dst)
        ]
        if groups.rank == dst:
            dst_ok.append([n for n, _ in got] == list(exported) and all(torch.equal(t, exported[n]) for n, t in got))
        else:
            dst_ok.append(got == [])
    return {
        "logits": logits,
        "export_keys": list(exported),
        "source_keys": sorted(original),
        "mismatched": mismatched,
        "dtypes": sorted({str(t.dtype) for t in exported.values()}),
        "small_bucket_same": [n for n, _ in small] == list(exported)
        and all(torch.equal(t, exported[n]) for n, t in small),
        "exported": exported if groups.rank == 0 else None,
        "dst_ok": dst_ok,
    }


def _recompute_grad_err(hf_dir: Path, tokens: torch.Tensor, groups: Any, tp: int) -> float:
    """Max abs difference of all grads with and without full activation recompute (exercises the RNG shims)."""
    from transformers import AutoConfig

    from megatron_dapo.actor.hf_weights import load_hf_into_model
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.config import ActorConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    grads = []
    for recompute in (False, True):
        cfg = ActorConfig(tensor_parallel=tp, dtype="fp32", recompute_activations=recompute)
        model = build_gpt_model(hf_config, cfg, groups)
        load_hf_into_model([model], hf_dir, hf_config, groups)
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
        model(tokens, position_ids, None).pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


@functools.cache
def cached_results(world: int) -> tuple[dict[str, Any], ...]:
    """Run actor_checks on `world` gloo ranks once per pytest process; per-rank results."""
    ckpts = {k: str(v) for k, v in every_tiny_checkpoint().items()}
    return tuple(run_distributed(actor_checks, world, ckpts, tokens(), timeout_s=300))


def tokens() -> torch.Tensor:
    """[2, 11] int64 test input (fixed seed)."""
    return torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(3))
