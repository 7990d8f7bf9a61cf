"""SGLang's own model code as the oracle of megatron_dapo/rollout/sglang_loader.py (the delta loader): run inside the
environment tools/sglang_cpu/setup_sglang_cpu.sh prepares, as one process (TP 1) or under torchrun (TP = world size).

Builds SGLang 0.5.23's Qwen2ForCausalLM (merged qkv_proj / gate_up_proj, vocabulary-parallel embedding padded to 64
rows per rank, row- and column-parallel shards) twice per rank in bf16 on CPU over gloo: `live` takes version 0 in
full, then versions 1..STEPS as deltas (rollout/delta.DeltaEncoder, the sender's own code) through SGLang's own path:
request_body -> SGLang's MultiprocessingSerializer.deserialize (SafeUnpickler) of this rank's entry -> SGLang's
WeightUpdater.update_weights_from_tensor(load_format=LOADER) with LOADER as a custom weight loader. `oracle` takes each
version in full through SGLang's load_weights; every parameter of `live` must equal it bit for bit. Then a delta
against a version the rank does not hold must be refused, leaving the weights as they were.

--fp8: the models are built with SGLang's block-FP8 quantization config (rollout/fp8.SGLANG_FP8_QUANTIZATION_CONFIG,
float8_e4m3fn weights and fp32 weight_scale_inv per 128 x 128 block, every TP shard whole blocks) and every version is
sent as rollout.weight_dtype "fp8" sends it (rollout/fp8.quantize_named_tensors of the bf16 master): the deltas are
those of the FP8 weights and of their scales.

Writes one JSON file per rank, OUT/rank{r}.json (--out; ranks printing at once would interleave their lines):
{"rank", "tp", "steps", "dtypes", "changed_fraction", "equal", "refused", "unchanged_after_refusal", "placements"}.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
from pathlib import Path

import torch


def init(world: int, rank: int) -> None:
    from sglang.srt.distributed.parallel_state import init_distributed_environment
    from sglang.srt.distributed.parallel_state import initialize_model_parallel
    from sglang.test.test_utils import publish_build_topology

    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    publish_build_topology(world_rank=rank, tp_size=world, ep_size=1, pp_size=1)
    initialize_model_parallel(backend="gloo")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--fraction", type=float, default=0.15, help="elements changed per step")
    ap.add_argument("--fp8", action="store_true", help='block-FP8 linear layers, as weight_dtype "fp8" sends them')
    ap.add_argument("--out", default=".", help="folder for the per-rank reports")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29651")
    init(world, rank)

    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.utils.common import MultiprocessingSerializer
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM as HFQwen2

    from megatron_dapo.rollout.delta import DeltaEncoder
    from megatron_dapo.rollout.delta import as_plain_tensors
    from megatron_dapo.rollout.delta import same_bits
    from megatron_dapo.rollout.fp8 import SGLANG_FP8_QUANTIZATION_CONFIG
    from megatron_dapo.rollout.fp8 import quantize_named_tensors
    from megatron_dapo.rollout.sglang_loader import LOADER
    from megatron_dapo.rollout.sglang_loader import SHAPE_SUFFIX
    from megatron_dapo.rollout.sglang_loader import _state
    from megatron_dapo.rollout.sglang_loader import request_body

    if args.fp8:  # every TP shard of every projection a whole number of 128 x 128 blocks, as SGLang requires
        dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2}
    else:
        dims = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = Qwen2Config(vocab_size=100, num_hidden_layers=2, tie_word_embeddings=args.tied, **dims)
    torch.manual_seed(0)
    master = {n: t.detach().to(torch.bfloat16).clone() for n, t in HFQwen2(cfg).state_dict().items()}
    if args.tied:
        master.pop("lm_head.weight", None)

    def sent() -> dict[str, torch.Tensor]:
        """What the trainer sends for the master weights: bf16, or block-FP8 linear weights and their scales."""
        return dict(quantize_named_tensors(master.items())) if args.fp8 else dict(master)

    quant_config = Fp8Config.from_config(SGLANG_FP8_QUANTIZATION_CONFIG) if args.fp8 else None
    torch.set_default_dtype(torch.bfloat16)
    live, oracle = Qwen2ForCausalLM(cfg, quant_config=quant_config), Qwen2ForCausalLM(cfg, quant_config=quant_config)
    torch.set_default_dtype(torch.float32)
    hf = sent()
    live.load_weights(list(hf.items()))
    updater = WeightUpdater(
        tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[LOADER],
        get_model=lambda: live, update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )  # fmt: skip

    def call(entries, version, base, end) -> None:
        body = request_body(entries, version=version, base=base, end=end, server_tp=world)
        named = MultiprocessingSerializer.deserialize(base64.b64decode(body["serialized_named_tensors"][rank]))
        ok, message = updater.update_weights_from_tensor(named_tensors=named, load_format=body["load_format"])
        assert ok, message

    encoder = DeltaEncoder()
    encoder.start()
    for name, t in hf.items():
        encoder.encode(name, t, 0)
    encoder.version = 0
    call([], 0, None, True)  # version 0 went in full (here by load_weights): the loader now holds it
    gen = torch.Generator().manual_seed(1)
    bump = 2**-3 if args.fp8 else 2**-7  # the relative spacing of e4m3 / bf16 values
    equal, fractions = True, []
    for step in range(1, args.steps + 1):
        for name, t in master.items():  # an update: a fraction of the elements move by a bf16 ulp (an FP8 one)
            moved = torch.rand(t.shape, generator=gen) < args.fraction
            sign = torch.sign(torch.randn(t.shape, generator=gen))
            master[name] = torch.where(moved, (t.float() * (1 + bump * sign)).to(torch.bfloat16), t)
        hf = sent()
        encoder.start()
        entries = []
        for name, t in hf.items():
            delta = encoder.encode(name, t, step)
            if delta.index is not None:
                entries.append((name + SHAPE_SUFFIX, torch.tensor(list(t.shape))))
            entries.extend(as_plain_tensors([(name, delta)]))
        fractions.append(encoder.pop_fraction())
        call(entries, step, encoder.version, True)
        encoder.version = step
        oracle.load_weights(list(hf.items()))
        want = dict(oracle.named_parameters())
        for n, p in live.named_parameters():
            equal &= same_bits(p, want[n])
    before = {n: p.clone() for n, p in live.named_parameters()}
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [(name + SHAPE_SUFFIX, torch.tensor(list(hf[name].shape))),
           *as_plain_tensors([(name, _one_delta(hf[name], args.steps + 1))])]  # fmt: skip
    try:
        call(bad, args.steps + 1, args.steps - 1, True)
        refused = ""
    except ValueError as err:
        refused = str(err)
    unchanged = all(same_bits(p, before[n]) for n, p in live.named_parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in live.parameters()})
    report = {"rank": rank, "tp": world, "steps": args.steps, "dtypes": dtypes, "changed_fraction": fractions,
              "equal": equal, "refused": refused, "unchanged_after_refusal": unchanged,
              "placements": {n: len(p) for n, p in _state(live).placements.items()}}  # fmt: skip
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))


def _one_delta(t: torch.Tensor, version: int):
    from megatron_dapo.rollout.delta import WeightDelta

    index = torch.tensor([0, 5], dtype=torch.int32)
    return WeightDelta(version, version - 2, index, torch.ones(2, dtype=t.dtype))


if __name__ == "__main__":
    main()
