"""How fast a chunked cuBLAS backward of the fused LM head would be (the design the linear_logprob_entropy backward
should move to; its Triton backward recomputes the logits H / BLOCK_HO times: 1,644 ms at Qwen2.5-7B's shape on an
H200, docs/benchmarks.md "Kernels / GPU"). Per token chunk: logits = h @ W.T (bf16, cuBLAS), fp32 softmax, d logits
for a log-prob gradient, then dh = d @ W and dW += d.T @ h. Not the op itself (no entropy term, no TP, no
temperature): a lower bound on the time such a backward needs, and its peak extra memory per chunk size.

    python3 tools/bench/lmhead_backward_chunked.py      (CUDA only; output: results/gpu/*_chunked_lmhead_backward.txt)
"""

from __future__ import annotations

import time

import torch

T, H, V = 4096, 3584, 152064  # tools/bench/logprob_kernels.py's "qwen2.5-7b" shape


def main() -> None:
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, V, (T,), device="cuda")
    grad = torch.randn(T, device="cuda")

    def backward(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        dh, dw = torch.empty_like(h), torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
        for s in range(0, T, chunk):
            p = torch.softmax((h[s : s + chunk] @ w.T).float(), -1)
            d = -p * grad[s : s + chunk, None]
            d[torch.arange(p.shape[0], device="cuda"), labels[s : s + chunk]] += grad[s : s + chunk]
            d = d.to(torch.bfloat16)
            dh[s : s + chunk] = d @ w
            dw.addmm_(d.T, h[s : s + chunk])
        return dh, dw

    for chunk in (512, 1024, 2048):
        backward(chunk)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for _ in range(5):
            backward(chunk)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / 5 * 1e3
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"chunked torch backward chunk={chunk}: {ms:.1f} ms, peak extra {extra:.0f} MiB")


if __name__ == "__main__":
    main()
