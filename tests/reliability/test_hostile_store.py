"""A hostile process writing to a running job's store (issue 38 item 1, row 99 under a real launch): the tiny job
under torchrun, and while step 2 generates, another process on the host connects to rank 0's job store (its port
told by the test driver, as an attacker would find it among the ports rank 0 listens on) as any local process could,
and writes pickles that would create a file when unpickled into the rollout queue's positions. Nothing runs; the job
ends with one line (exit 2) naming the queue position and saying another process wrote to the store, with no
traceback of a rank."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_dapo.rollout.stream import StoreQueue
from tests.reliability.test_hangs import _start
from tests.reliability.test_hangs import _stop
from tests.reliability.test_hangs import tiny  # noqa: F401 (the module's fixture)
from tests.reliability.test_run_faults import _error_lines
from tests.reliability.test_run_faults import _torchrun
from tests.reliability.test_run_faults import _wait_for


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.makedirs, (self.path,))


@pytest.mark.slow
def test_pickles_written_into_a_running_jobs_store_run_nothing(tiny, tmp_path):  # noqa: F811
    marker = tmp_path / "pwned"
    cmd = _torchrun(tiny, tmp_path / "run", "--trainer.total_steps=4", "--algorithm.max_gen_batches=10")
    cmd[cmd.index("megatron_dapo.cli")] = "tests._hooks_driver"
    port_file = tmp_path / "job_store_port"
    proc, lines = _start(cmd, SLOW_GEN="2:1", JOB_STORE_PORT_FILE=str(port_file))
    try:
        _wait_for(lambda: any("generation of step 2 is slow" in x for x in lines), 240, "step 2's slow generation")
        port = int(port_file.read_text())
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
        payload = pickle.dumps(_Payload(str(marker)))
        for step in (2, 3):
            queue = StoreQueue(store, step, num_carried=0)  # the queue's own key names
            for position in range(64):
                queue.store.set(str(position), payload)
        proc.wait(timeout=240)
    finally:
        _stop(proc)
    out = "".join(lines)
    time.sleep(0.5)
    assert not marker.exists(), "a pickle from the store ran"
    errors = _error_lines(out)
    assert errors, out[-3000:]
    assert len(set(errors)) == 1, errors
    assert "on the job store is not a message of this job (wire: not a message of this encoding" in errors[0]
    assert "another process wrote to the store" in errors[0]
    assert "exitcode  : 2" in out, out[-3000:]  # a clear error, not a retryable failure
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]  # torchrun's summary only
