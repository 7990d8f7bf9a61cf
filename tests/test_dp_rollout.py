"""Rollouts reach only the data-parallel ranks that train on them, and the final HF export gathers only on the
writer: one DAPO step of the trainer at DP=2 (TP=1) under torchrun --rdzv-backend c10d on CPU (tiny model), with
actor.shared_prefix on as in the main CPU job."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.dev.tiny import make_tiny_model
from megatron_dapo.dev.tiny import make_tiny_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("dp_rollout")
    paths = make_tiny_run(root, num_train=16, num_test=4)
    # A model large enough (~14M parameters) that a full copy stands out in the resident set; HF dtype bf16, so the
    # export converts (a copy, not a view of the fp32 parameters) as it does on GPU.
    model = make_tiny_model(root / "model_big", hidden=512, layers=6)
    config = json.loads((model / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    out = root / "out"
    out.mkdir()
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        "--nnodes=1",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "_dp_rollout_worker.py"),
        str(out),
        str(ROOT / "examples" / "tiny_cpu.yaml"),
        f"--actor.model_path={model}",
        f"--data.train_files={paths['train']}",
        f"--data.eval_files={paths['test']}",
        f"--trainer.run_dir={root / 'run'}",
        "--actor.tensor_parallel=1",
        "--algorithm.dynamic_sampling=false",  # every group is trained on, whatever the random model answers
        "--rollout.partial=true",
        "--rollout.max_inflight_prompts=6",  # positions 0-5 start at once: 4 trained on, 4 and 5 carried
        "--actor.logprob_impl=reference",  # no Triton interpreter (tests/conftest.py sets it) on a 512-wide model
        "--actor.shared_prefix=true",  # as the main CPU job: groups split over DP ranks share within a rank
        "--trainer.eval_every=0",
        "--logging.tensorboard=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_rollout_rows_reach_only_their_dp_rank(ranks: list[dict]) -> None:
    assert [r["dp_rank"] for r in ranks] == [0, 1] and ranks[0]["dp_size"] == 2
    num_rows = ranks[0]["num_rows"]
    assert num_rows == 16  # 4 prompts x group_size 4
    got = [set(map(int, r["received"])) for r in ranks]
    assert got[0] == set(ranks[0]["plan"][0]) and got[1] == set(ranks[0]["plan"][1])
    assert not got[0] & got[1] and got[0] | got[1] == set(range(num_rows))
    assert got[0] and got[1]
    # Each received row is exactly what its generator produced. Both engines take prompts from one shared queue, so
    # how many each generated depends on timing (on a loaded machine one may take them all): some rows crossed ranks.
    generated = {int(k): v for r in ranks for k, v in r["generated"].items()}
    assert set(generated) == set(range(num_rows))
    for r in ranks:
        for k, tokens in r["received"].items():
            assert tokens == generated[int(k)], (r["rank"], k)
    crossed = [k for r in ranks for k in r["received"] if k not in r["generated"]]
    assert crossed, "no row was generated on one rank and trained on the other"
    # Rows travel only to their owner (the sets above): no rank receives more than was sent in total.
    total_sent = sum(r["bytes_sent"] for r in ranks)
    received = [r["bytes_received"] for r in ranks]
    assert sum(received) > 0 and all(b <= total_sent for b in received), (received, total_sent)


def test_shared_prefix_trains_under_torchrun(ranks: list[dict]) -> None:
    # 8 rows of 4 groups on each DP rank: some group has >= 2 rows on a rank, so its prompt is computed once there
    for r in ranks:
        assert r["shared_fraction"] is not None and r["shared_fraction"] > 0, r["shared_fraction"]
        assert r["loss"] is not None and math.isfinite(r["loss"])


def test_carried_groups_stay_with_their_owner_and_checkpoint_in_full(ranks: list[dict]) -> None:
    for r in ranks:  # only the carried groups' rows are still stored, on the rank that generated them
        assert r["store_keys"] == r["carry_owned"], r["rank"]
    generated = {k: v for r in ranks for k, v in r["carry_generated"].items()}
    assert len(generated) >= 2  # positions 4 and 5 at least (finished or not)
    for r in ranks:  # the trainer state (what rank 0 writes) holds the full groups on every rank
        state = {str(s["index"]): s["rows"] for s in r["carry_state"]}
        assert state == generated


def test_final_export_gathers_only_on_the_writer(ranks: list[dict]) -> None:
    writer, other = ranks
    model_bytes = writer["model_bytes"]
    assert model_bytes > 20e6
    assert writer["written_matches"]
    assert writer["export_bytes"] == model_bytes  # the writer received every tensor ...
    assert other["export_bytes"] == 0 and other["export_tensors"] == 0  # ... the other rank none
    # Peak resident set over the export (freed heap trimmed first): the writer's grows by a model copy (the
    # measurement sees one), the other rank's by far less (without dst_rank it grew by ~1.5 copies too).
    grew = other["rss_peak"] - other["rss_start"]
    assert writer["rss_peak"] - writer["rss_start"] > 0.8 * model_bytes, writer
    assert grew < 0.25 * model_bytes, f"rank 1 resident set grew by {grew / 1e6:.1f} MB (model {model_bytes / 1e6:.1f})"
    print(
        f"export: model {model_bytes / 1e6:.1f} MB; peak RSS increase rank 0 (writer) "
        f"{(writer['rss_peak'] - writer['rss_start']) / 1e6:.1f} MB, rank 1 {grew / 1e6:.1f} MB; rollout bytes "
        f"received {[r['bytes_received'] for r in ranks]}"
    )
