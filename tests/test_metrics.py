import json
import math

import pytest
import torch

from megatron_dapo.metrics import MetricsLogger
from megatron_dapo.metrics import PhaseTimer
from megatron_dapo.metrics import Reduce
from megatron_dapo.metrics import Stat
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import identity
from megatron_dapo.metrics import logprob_mismatch
from megatron_dapo.metrics import merge_stats
from megatron_dapo.metrics import mismatch_stats
from megatron_dapo.metrics import plot_run
from megatron_dapo.metrics import read_metrics
from megatron_dapo.metrics import response_metrics


def test_response_metrics_values():
    m = response_metrics(
        torch.tensor([4, 10, 6]),
        torch.tensor([False, True, False]),
        torch.tensor([1.0, -2.0, -1.0]),
        torch.tensor([True, False, False]),
        torch.tensor([0.0, -1.0, 0.0]),
    )
    assert m["reward/mean"] == pytest.approx(-2 / 3) and m["reward/acc"] == pytest.approx(1 / 3)
    assert m["response/length_max"] == 10 and m["response/truncation_rate"] == pytest.approx(1 / 3)
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-1 / 3)


def test_logprob_mismatch():
    a = torch.tensor([[0.0, -1.0, -2.0]])
    e = torch.tensor([[5.0, -1.5, -2.0]])
    m = logprob_mismatch(a, e, torch.tensor([[0.0, 1.0, 1.0]]))
    assert m["rollout/logprob_mismatch"] == pytest.approx(0.25) and m["rollout/logprob_mismatch_max"] == 0.5


def test_logger_jsonl_plots_and_timer(tmp_path):
    timer = PhaseTimer()
    with timer("generate"):
        pass
    logger = MetricsLogger(tmp_path, console="plain", jsonl=True, tensorboard=True, total_steps=2)
    for step in (1, 2):
        logger.log(step, {"reward/acc": 0.1 * step, "actor/entropy": float("nan"), **timer.metrics()})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/acc"] == pytest.approx(0.2)
    assert rows[0]["actor/entropy"] is None and rows[0]["time/generate"] >= 0
    assert any((tmp_path / "tb").iterdir())
    files = plot_run(tmp_path)
    assert (tmp_path / "plots" / "accuracy.png") in files
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n{bad\n")
    warnings: list[str] = []
    assert read_metrics(tmp_path, warnings.append) == [{"step": 1}]
    assert len(warnings) == 1 and "metrics.jsonl line 2: not a metrics row (not JSON" in warnings[0]
    assert not math.isnan(rows[1]["reward/acc"])


def test_stats_merge_by_their_declared_reduction():
    parts = [
        {"m": Stat.mean(3.0, 2.0), "s": Stat.sum(1.0), "hi": Stat.max(-1.0), "lo": Stat.min(4.0)},
        {"m": Stat.mean(5.0, 6.0), "s": Stat.sum(2.5), "hi": Stat.max(7.0), "lo": Stat.min(-2.0), "only": Stat.max(1)},
    ]
    got = finalize(merge_stats(parts))
    assert got == {"m": 1.0, "s": 3.5, "hi": 7.0, "lo": -2.0, "only": 1.0}
    assert finalize({"empty": identity(Reduce.MEAN)}) == {"empty": 0.0}  # no weight: 0, not a division by zero
    for reduce in Reduce:  # the identity changes nothing
        part = {"k": Stat(reduce, 2.5, 3.0 if reduce is Reduce.MEAN else 1.0)}
        assert merge_stats([{"k": identity(reduce)}, part]) == part
    with pytest.raises(ValueError, match="a mean part met a max part"):
        merge_stats([{"k": Stat.mean(1, 1)}, {"k": Stat.max(1)}])


def test_mismatch_of_row_shards_merges_to_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    actor, engine = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    whole = logprob_mismatch(actor, engine, mask)
    shards = [torch.tensor(rows) for rows in ([0, 4], [1, 2, 3], [5])]
    got = finalize(merge_stats(mismatch_stats(actor[r], engine[r], mask[r]) for r in shards))
    assert got.keys() == whole.keys()
    for key, value in whole.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def _all_reduce_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from megatron_dapo.metrics import all_reduce_stats

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    parts = _PARTS[rank] if rank < len(_PARTS) else {k: identity(s.reduce) for k, s in _PARTS[0].items()}
    got = all_reduce_stats(parts, [None, dist.group.WORLD])
    torch.save(finalize(got), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


_PARTS = [
    {"m": Stat.mean(0.1, 3.0), "s": Stat.sum(2.0), "hi": Stat.max(0.3), "lo": Stat.min(-1.0)},
    {"m": Stat.mean(0.7, 1.0), "s": Stat.sum(5.0), "hi": Stat.max(-2.0), "lo": Stat.min(0.5)},
]


def test_all_reduce_stats_over_gloo_equals_the_merge(tmp_path):
    """Three ranks, the third holding only identities (a pipeline stage without the loss): every rank gets the merge
    of the two real parts, bit for bit."""
    import torch.multiprocessing as mp

    world = 3
    mp.spawn(_all_reduce_worker, args=(world, f"file://{tmp_path}/store", str(tmp_path)), nprocs=world)
    expected = finalize(merge_stats(_PARTS))
    for rank in range(world):
        assert torch.load(tmp_path / f"rank{rank}.pt") == expected
