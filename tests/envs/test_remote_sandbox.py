"""RemoteSandbox against a local stand-in of SandboxFusion's run_code (the request and reply shapes its API documents),
served here by LocalSandbox: results map to the same statuses, the output cap holds, an outage is an observation."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer

import pytest

from megatron_dapo.envs.sandbox import LocalSandbox
from megatron_dapo.envs.sandbox import RemoteSandbox
from megatron_dapo.envs.sandbox import SandboxLimits

REQUEST_KEYS = {"code", "language", "run_timeout", "compile_timeout", "memory_limit_MB", "stdin", "files",
                "fetch_files"}  # fmt: skip


class _StandIn(BaseHTTPRequestHandler):
    failures_left = 0  # replies with HTTP 500 before answering
    garbage = False  # replies 200 with a body that is not run_code's shape
    seen: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if self.path != "/run_code" or type(self).failures_left > 0:
            type(self).failures_left -= 1
            self.send_response(500)
            self.end_headers()
            return
        if type(self).garbage:
            reply = {"status": "Success", "run_result": None}
        else:
            limits = SandboxLimits(wall_s=float(body["run_timeout"]), memory_mb=int(body["memory_limit_MB"]),
                                   max_output_bytes=1 << 20)  # fmt: skip
            r = LocalSandbox(limits).run(body["code"], body["stdin"])
            status = {"timeout": "TimeLimitExceeded", "ok": "Finished", "error": "Finished"}.get(r.status, "Error")
            reply = {"status": "Success" if r.status == "ok" else "Failed", "message": "", "compile_result": None,
                     "run_result": {"status": status, "execution_time": r.seconds, "return_code": r.exit_code,
                                    "stdout": r.stdout, "stderr": r.stderr}, "files": {}}  # fmt: skip
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def service():
    _StandIn.failures_left, _StandIn.garbage, _StandIn.seen = 0, False, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_results_map_to_the_local_statuses_in_run_codes_shape(service):
    box = RemoteSandbox(service, SandboxLimits(wall_s=2.0))
    ok = box.run("print(input() * 2)", stdin="ab")
    assert (ok.status, ok.stdout, ok.exit_code) == ("ok", "abab\n", 0)
    assert set(_StandIn.seen[0]) == REQUEST_KEYS and _StandIn.seen[0]["language"] == "python"
    error = box.run("1 / 0")
    assert error.status == "error" and error.exit_code == 1 and "ZeroDivisionError" in error.stderr
    timeout = box.run("import time\ntime.sleep(30)")
    assert timeout.status == "timeout" and timeout.exit_code is None
    loud = RemoteSandbox(service, SandboxLimits(max_output_bytes=64)).run("print('y' * 1000)")
    assert loud.status == "ok" and loud.truncated and len(loud.stdout) == 64


def test_a_failing_service_is_retried_then_an_unavailable_observation(service):
    _StandIn.failures_left = 1
    assert RemoteSandbox(service, retries=2, backoff_s=0.01).run("print(1)").stdout == "1\n"  # one 500, then an answer
    _StandIn.garbage = True
    garbled = RemoteSandbox(service, retries=1, backoff_s=0.01).run("print(1)")
    assert garbled.status == "unavailable" and "no run_result in the reply" in garbled.stderr
    down = RemoteSandbox("http://127.0.0.1:9", retries=1, backoff_s=0.01).run("print(1)")  # nothing listens
    assert down.status == "unavailable" and "did not answer after 2 tries" in down.stderr and "\n" not in down.stderr
