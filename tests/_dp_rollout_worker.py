"""torchrun worker for tests/test_dp_rollout.py: one DAPO step at DP=2 (TP=1) on a tiny model, then the final HF
export. Records, per rank, which rollout rows it received and what it held during the export. Test hooks live
here (wrapping trainer/actor methods), not in the trainer.

    python -m torch.distributed.run --rdzv-backend c10d ... tests/_dp_rollout_worker.py OUT_DIR CONFIG [--overrides]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRSS:
    """Samples this process's resident set every millisecond in a thread; `peak` is the largest value seen."""

    def __init__(self) -> None:
        self.peak = self.start = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer import DAPOTrainer

    out_dir, config_path, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    trainer = DAPOTrainer(load_config(config_path, overrides))
    rank = trainer.rank
    rec: dict = {"rank": rank, "dp_rank": trainer.groups.dp_rank, "dp_size": trainer.groups.dp_size}

    # What this rank generated (global row id -> tokens), and what routing hands it.
    route = trainer.route

    def recording_route(kept):
        generated = {}
        row = 0
        for summary in kept:
            for i in range(summary.group_size):
                if summary.owner == rank:
                    r = trainer.generation.groups[summary.key].rollouts[i]
                    generated[row] = r.prompt_ids.tolist() + r.response_ids.tolist()
                row += 1
        batch, plan = route(kept)
        received = {}
        for k, gid in enumerate(trainer.routed_rows):
            last = int(batch.response_mask[k].nonzero().max()) + 1
            received[gid] = batch.tokens[k, :last].tolist()
        rec.update(
            num_rows=plan.num_rows,
            plan=[plan.rows_of(d) for d in range(plan.dp_size)],
            generated={str(k): v for k, v in generated.items()},
            received={str(k): v for k, v in received.items()},
            bytes_received=trainer.exchange.bytes_received,
            bytes_sent=trainer.exchange.bytes_sent,
        )
        return batch, plan

    trainer.route = recording_route
    trainer.step = 1
    metrics = trainer.train_step()
    rec["shared_fraction"] = metrics.get("train/shared_fraction")
    rec["loss"] = metrics.get("actor/loss")
    # Groups past the cut (rollout.partial) are carried: every rank knows them, their rows stay with the rank that
    # generated them; a checkpoint's trainer state gathers them back into full groups.
    gen = trainer.generation
    rec["carry_owned"] = sorted(e.key for e in gen.carry if e.owner == rank)
    rec["store_keys"] = sorted(gen.carry_rows)
    rec["carry_state"] = [
        {"index": s["index"], "rows": [r["prompt_ids"].tolist() + r["response_ids"].tolist() for r in s["rollouts"]]}
        for s in trainer.trainer_state()["carry"]
    ]
    rec["carry_generated"] = {
        str(e.index): [r.prompt_ids.tolist() + r.response_ids.tolist() for r in gen.carry_rows[e.key]]
        for e in gen.carry
        if e.owner == rank
    }

    # The final export: count what the export iterator hands this rank, and the resident-set peak around it.
    export = trainer.actor.export_hf_weights
    held = {"bytes": 0, "tensors": 0}

    def counting_export(*args, **kwargs):
        for name, t in export(*args, **kwargs):
            held["bytes"] += t.numel() * t.element_size()
            held["tensors"] += 1
            yield name, t

    trainer.actor.export_hf_weights = counting_export
    hf_dir = out_dir / "hf_final"
    import ctypes
    import gc

    # Hand freed heap pages back to the OS first, so a new full-model copy shows up as resident-set growth instead of
    # reusing memory the training step freed.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with PeakRSS() as rss:
        trainer.actor.save_hf(str(hf_dir), tokenizer=trainer.inputs.tokenizer)  # as the trainer closes
    trainer.actor.export_hf_weights = export
    rec.update(export_bytes=held["bytes"], export_tensors=held["tensors"], rss_start=rss.start, rss_peak=rss.peak)
    # The written file equals the full export every rank can still make (dst_rank=None).
    full = {name: t.detach().cpu().clone() for name, t in trainer.actor.export_hf_weights()}
    rec["model_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    if rank == 0:
        written = load_file(str(hf_dir / "model.safetensors"))
        rec["written_matches"] = set(written) == set(full) and all(torch.equal(written[k], full[k]) for k in full)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rec))
    trainer.generation.close()
    trainer.exchange.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
