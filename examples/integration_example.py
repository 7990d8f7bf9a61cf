"""DAPO inside your own Megatron training loop (docs/integration.md).

    torchrun --nproc-per-node 2 examples/integration_example.py            # CPU (gloo), TP=2, tiny random GPT
    torchrun --nproc-per-node 2 examples/integration_example.py --dapo-loss-eps-high 0.3 --steps 5

A plain user-style script: it builds its own GPTModel, DDP and optimizer with megatron-core, and only takes three
things from megatron_dapo: the `--dapo-*` arguments, `dapo_loss_func` (the loss_func its forward_step_func returns)
and `sequence_logprobs_and_entropy` (old log-probs before the update). The batch is synthetic: random prompts and
responses with random advantages; the loss must go down on it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_dapo.integration import add_dapo_args
from megatron_dapo.integration import dapo_loss_config_from_args
from megatron_dapo.integration import dapo_loss_func
from megatron_dapo.integration import local_loss_denominator
from megatron_dapo.integration import sequence_logprobs_and_entropy

VOCAB = 250  # the model pads it to a multiple of 128 * TP; the padded columns must not count


def build(tp: int):
    """Process groups, a tiny GPTModel (vocab-parallel output), DDP and a Megatron optimizer: user code."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    if on_cpu:  # megatron-core assumes CUDA; these explicit shims let it run over gloo
        from megatron_dapo.actor.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if on_cpu else "nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
    )
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model.to(torch.cuda.current_device())
    )
    # megatron's clip_grad_by_total_norm_fp32 asserts CUDA gradients, so the CPU run does not clip.
    clip_grad = 0.0 if on_cpu else 1.0
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=5e-4, weight_decay=0.0, clip_grad=clip_grad), [model])
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, ps


def synthetic_batch(num: int, prompt_len: int = 6, resp_len: int = 10) -> dict[str, torch.Tensor]:
    """Same on every rank (seeded): tokens [N, S], loss_mask [N, S] (response positions), advantages [N]."""
    gen = torch.Generator().manual_seed(0)
    seq = prompt_len + resp_len
    tokens = torch.randint(0, VOCAB, (num, seq), generator=gen)
    loss_mask = torch.zeros(num, seq)
    for i in range(num):
        loss_mask[i, prompt_len : seq - (i % 3)] = 1.0  # ragged responses, right padding
    advantages = torch.randn(num, generator=gen)
    return {"tokens": tokens, "loss_mask": loss_mask, "advantages": advantages}


def main() -> None:
    parser = add_dapo_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    args = parser.parse_args()
    loss = dapo_loss_config_from_args(args)  # the --dapo-policy-loss's config: DAPOConfig(eps_low, eps_high, ...)

    tp = 2 if int(os.environ.get("WORLD_SIZE", 1)) % 2 == 0 else 1
    model, optimizer, ps = build(tp)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = torch.cuda.current_device()
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp_size, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    batch = synthetic_batch(8)
    rows = slice(dp_rank * 8 // dp_size, (dp_rank + 1) * 8 // dp_size)  # this DP rank's responses
    local = {k: v[rows].to(device) for k, v in batch.items()}
    mbs = args.micro_batch_size
    micro = [{k: v[i : i + mbs] for k, v in local.items()} for i in range(0, len(local["tokens"]), mbs)]
    positions = torch.arange(local["tokens"].shape[1], device=device)

    # Old log-probs: the policy before the update (a forward pass with the same vocab-parallel function).
    with torch.no_grad():
        for mb in micro:
            logits = model(mb["tokens"], positions.expand_as(mb["tokens"]), None)  # [b, S, V_padded / tp]
            logp, _ = sequence_logprobs_and_entropy(logits, mb["tokens"], tp_group=tp_group, vocab_size=VOCAB)
            mb["old_logp"] = logp * mb["loss_mask"]

    # D: valid tokens of the whole mini-batch, summed over micro-batches and data-parallel ranks.
    num_tokens = sum(local_loss_denominator(mb["loss_mask"], loss.loss_agg_mode) for mb in micro).to(device)
    dist.all_reduce(num_tokens, group=dp_group)

    def forward_step(data_iterator, model):  # a plain user forward_step_func
        mb = next(data_iterator)
        logits = model(mb["tokens"], positions.expand_as(mb["tokens"]), None)
        loss_func = dapo_loss_func(
            mb["tokens"], mb["loss_mask"], mb["old_logp"], mb["advantages"],
            num_tokens=num_tokens, loss=loss, tp_group=tp_group, vocab_size=VOCAB,
            num_microbatches=len(micro), dp_size=dp_size,
        )  # fmt: skip
        return logits, loss_func

    losses = []
    for step in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=local["tokens"].shape[1],
            micro_batch_size=mbs,
        )
        # Each metric is [numerator, denominator]: sum over micro-batches and DP ranks, then divide.
        totals = torch.stack([m["loss"] for m in metrics]).sum(0)
        clip = torch.stack([m["clipfrac_high"] for m in metrics]).sum(0)
        dist.all_reduce(totals, group=dp_group)
        dist.all_reduce(clip, group=dp_group)
        success, grad_norm, _ = optimizer.step()
        grad_norm = optimizer.get_grad_norm() if grad_norm is None else grad_norm
        losses.append(float(totals[0] / totals[1]))
        if dist.get_rank() == 0:
            print(
                f"step {step}: loss {losses[-1]:+.5f} grad_norm {float(grad_norm):.4f} "
                f"clipfrac_high {float(clip[0] / clip[1]):.3f} updated {success}",
                flush=True,
            )
    if dist.get_rank() == 0:
        verdict = "decreased" if losses[-1] < losses[0] else "did NOT decrease"
        print(f"DAPO loss {verdict}: {losses[0]:+.5f} -> {losses[-1]:+.5f}", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
