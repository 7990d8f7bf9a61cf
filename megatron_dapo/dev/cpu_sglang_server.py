"""A stand-in for one SGLang 0.5.23 HTTP server on CPU (SGLang has no CPU build), for jobs whose engines are servers:

    python -m megatron_dapo.dev.cpu_sglang_server --model DIR --max-new-tokens CAP --port-file FILE

It generates with megatron_dapo's embedded engine (TransformersEngine, fp32) and answers the routes the trainer's
SGLangServerEngine calls, with SGLang's semantics as read in its source (names in rollout/sglang_api.SGLANG_API):
/generate (a batch of rows; meta_info with output_token_logprobs, finish_reason, weight_versions spans),
/abort_request (abort_all: every call in flight returns its tokens so far), /get_server_info, the weight-update group
(/init_weights_update_group: joins the trainer's group as SGLang's receiver does, rank rank_offset, refusing a name it
already holds with HTTP 400 as torch makes SGLang do; /destroy_weights_update_group;
/update_weights_from_distributed: receives each tensor by broadcast from rank 0 and loads it, weight_version stamps
the tokens from then on), /begin_weight_update, /end_weight_update, /flush_cache (refused while requests run unpaused),
/pause_generation (no row advances until /continue_generation; requests keep their tokens, as retract does),
/update_weights_from_tensor with a load_format listed in --custom-weight-loader (imported and called as
`loader(model, named_tensors)`, `model.load_weights` copying HF-named tensors into the parameters; an exception there
ends the server, as SGLang's scheduler does; /get_server_info lists the loaders; a call that carries tensors prints
`loader call: N tensors, F fp8 halves`).
With --dump-dir DIR each /end_weight_update writes the engine's weights to DIR/v{weight_version}.pt.
With --json-model-override-args carrying a quantization_config (reported by /get_server_info, as SGLang's server args
are) it serves block FP8 as SGLang does with rollout/fp8.SGLANG_FP8_QUANTIZATION_CONFIG: the projections are held as
float8_e4m3fn weights and fp32 `_scale_inv` blocks, which updates and the delta loader write (a float8 broadcast
arrives as its bytes: gloo has no float8 type), and the engine generates from their dequantization.

A continued (partial) request arrives as prompt + its tokens with max_new_tokens = cap - their number, as SGLang
gets it; the engine continues it as a prefix of the job's cap (--max-new-tokens) and only the new tokens go back.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.fp8_format import SCALE_SUFFIX
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import GenerationRequest
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout.sglang_api import MAX_RUNNING_KEY
from megatron_dapo.rollout.sglang_api import WEIGHT_VERSIONS_KEY
from megatron_dapo.rollout.sglang_engine import init_weight_update_group
from megatron_dapo.rollout.sglang_loader import carried_names
from megatron_dapo.rollout.transformers_engine import TransformersEngine

DEFAULT = -1
"""The engine's weight_version before any update of ours (SGLang's "default")."""


class _LoaderModel:
    """What SGLang hands a custom weight loader: the model, whose load_weights copies HF-named tensors into its
    parameters (here through the embedded engine's writer). fp8: the projections' FP8 halves (float8_e4m3fn weight,
    fp32 `_scale_inv`) are parameters of their own, as in SGLang's Fp8LinearMethod; `refresh` dequantizes the named
    ones into the engine."""

    def __init__(self, engine: TransformersEngine, fp8: bool = False) -> None:
        self.engine, self.fp8 = engine, fp8
        self.halves: dict[str, torch.Tensor] = {}

    def named_parameters(self) -> Any:
        yield from self.engine.model.named_parameters()
        yield from ((f"fp8:{name}", t) for name, t in self.halves.items())

    def load_weights(self, weights: list) -> None:
        rest = []
        for name, t in weights:
            if self.fp8 and (name in self.halves or t.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIX)):
                if name in self.halves:
                    self.halves[name].copy_(t)
                else:
                    self.halves[name] = t.clone()
            else:
                rest.append((name, t))
        self.engine.update_weights(rest)

    def refresh(self, names: list[str]) -> None:
        """The engine's projections for these HF names (either FP8 half) dequantized from the halves held."""
        if not self.fp8:
            return
        bases = dict.fromkeys(n.removesuffix(SCALE_SUFFIX) for n in names)
        self.engine.update_weights([(x, self.halves[x]) for b in bases if b + SCALE_SUFFIX in self.halves
                                    for x in (b, b + SCALE_SUFFIX)])  # fmt: skip


class Server:
    def __init__(self, model: str, cap: int, max_running: int, dump_dir: str | None = None,
                 custom_weight_loader: list[str] | None = None,
                 json_model_override_args: str = "{}") -> None:  # fmt: skip
        self.engine = TransformersEngine(model, dtype=torch.float32, device="cpu", max_running=max_running,
                                         max_context=512)  # fmt: skip
        self.engine.weight_version = DEFAULT
        self.cap, self.max_running = cap, max_running
        self.lock = threading.Lock()  # the engine, between its steps
        self.paused = False
        self.groups: dict[str, Any] = {}  # by group_name, as SGLang keeps them
        self.dump_dir = dump_dir
        self.custom_weight_loader = list(custom_weight_loader or [])
        self.json_model_override_args = json_model_override_args
        fp8 = "quantization_config" in json.loads(json_model_override_args)
        self.loader_model = _LoaderModel(self.engine, fp8)
        self.pending: dict[str, tuple[int, threading.Event, list]] = {}  # rid -> (prefix length, done, [result])
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self.lock:
                busy = not self.paused and self.engine.num_unfinished()
                finished = self.engine.step() if busy else []
            for rid, rollout in finished:
                self._deliver(rid, rollout)
            if not busy:
                time.sleep(0.002)

    def _deliver(self, rid: str, rollout: Rollout) -> None:
        n_prefix, done, slot = self.pending.pop(rid)
        slot.append((n_prefix, rollout))
        done.set()

    def generate(self, body: dict) -> list[dict]:
        waits = []
        with self.lock:
            for ids, sp, rid in zip(body["input_ids"], body["sampling_params"], body["rid"], strict=True):
                n_prefix = self.cap - int(sp["max_new_tokens"])
                prompt, done_ids = ids[: len(ids) - n_prefix], ids[len(ids) - n_prefix :]
                prefix = Rollout(prompt, done_ids, [0.0] * n_prefix, FinishReason.ABORT, segments=((0, DEFAULT),))
                params = SamplingParams(
                    max_new_tokens=self.cap, temperature=sp["temperature"], top_p=sp["top_p"],
                    top_k=max(int(sp["top_k"]), 0), stop_token_ids=tuple(sp["stop_token_ids"]),
                )  # fmt: skip
                event, slot = threading.Event(), []
                self.pending[rid] = (n_prefix, event, slot)
                self.engine.submit([GenerationRequest(rid, prompt, int(sp["sampling_seed"]),
                                                      prefix if n_prefix else None)], params)  # fmt: skip
                waits.append((event, slot))
        outs = []
        for event, slot in waits:
            event.wait()
            n_prefix, rollout = slot[0]
            outs.append(self._output(rollout, n_prefix))
        return outs

    @staticmethod
    def _output(rollout: Rollout, n_prefix: int) -> dict:
        ids = rollout.response_ids.tolist()[n_prefix:]
        logps = rollout.engine_logp.tolist()[n_prefix:]
        # segments is empty for a request aborted before its first token (no spans, as SGLang sends none of ours)
        ends = [s for s, _ in rollout.segments[1:]] + ([len(rollout.response_ids)] if rollout.segments else [])
        spans: list[dict] = []
        for (start, version), end in zip(rollout.segments, ends, strict=True):
            start, end = max(start - n_prefix, 0), end - n_prefix
            if end <= start:  # the carried prefix's own tokens, which are not sent back
                continue
            name = "default" if version == DEFAULT else str(version)
            if spans and spans[-1]["version"] == name:
                spans[-1]["end"] = end
            else:
                spans.append({"version": name, "start": start, "end": end})
        kind = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}[rollout.finish]
        reason = {"type": kind, **({"matched": ids[-1]} if kind == "stop" else {})}
        meta = {"finish_reason": reason, "output_token_logprobs": [[lp, t, None] for lp, t in zip(logps, ids)],
                WEIGHT_VERSIONS_KEY: spans}  # fmt: skip
        return {"output_ids": ids, "meta_info": meta}

    def abort_all(self) -> None:
        with self.lock:
            aborted = self.engine.abort()
        for rid, rollout in aborted:
            self._deliver(rid, rollout)

    def join_group(self, body: dict) -> None:
        self.groups[body["group_name"]] = init_weight_update_group(
            body["master_address"], int(body["master_port"]), int(body["world_size"]), body["group_name"],
            rank=int(body["rank_offset"]), backend=body["backend"],
        )  # fmt: skip

    def update(self, body: dict) -> None:
        bucket = []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            wire = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            dist.broadcast(wire, group_src=0, group=self.groups[body["group_name"]])
            bucket.append((name, t))
        with self.lock:
            self.loader_model.load_weights(bucket)
            self.loader_model.refresh([n for n, _ in bucket])
            self._stamp(body.get("weight_version"))

    def update_from_tensor(self, body: dict) -> None:
        """SGLang's update_weights_from_tensor on TP rank 0: its payload entry unpickled, a listed custom loader called
        on the model (SGLang raises NotImplementedError for any other load_format)."""
        load_format = body.get("load_format")
        if load_format not in self.custom_weight_loader:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        module, _, fn = load_format.rpartition(".")
        with self.lock:
            getattr(importlib.import_module(module), fn)(self.loader_model, named)
            carried = carried_names(named)
            self.loader_model.refresh(carried)
            self.engine.weights.note_written(carried)
            if carried:
                fp8 = sum(n in self.loader_model.halves for n in carried)
                print(f"loader call: {len(carried)} tensors, {fp8} fp8 halves", flush=True)
            self._stamp(body.get("weight_version"))

    def _stamp(self, version: str | None) -> None:
        if version is not None and int(version) != self.engine.weight_version:
            self.engine.weight_version = int(version)
            print(f"update version={version} paused={self.paused} in_flight={self.engine.num_unfinished()}",
                  flush=True)  # fmt: skip

    def dump(self) -> None:
        """With --dump-dir: the engine's weights as loaded, v{weight_version}.pt (what tests compare with the actor's
        export)."""
        if self.dump_dir is not None:
            state = {k: v.clone() for k, v in self.engine.model.state_dict().items()}
            torch.save(state, Path(self.dump_dir) / f"v{self.engine.weight_version}.pt")


def make_handler(server: Server) -> type:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, obj, status: int = 200) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            assert self.path == "/get_server_info", self.path
            self._reply({"internal_states": [{MAX_RUNNING_KEY: server.max_running}],
                         "custom_weight_loader": server.custom_weight_loader,
                         "json_model_override_args": server.json_model_override_args})  # fmt: skip

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            ok = {"success": True, "message": ""}
            if self.path == "/generate":
                return self._reply(server.generate(body))
            if self.path == "/abort_request":
                server.abort_all()
                return self._reply(None)
            if self.path == "/init_weights_update_group":
                try:  # as SGLang: a group it cannot make (a name it already holds) is HTTP 400 with the reason
                    server.join_group(body)
                except Exception as err:
                    return self._reply({"success": False, "message": f"Failed to initialize custom process group: "
                                                                     f"{err}."}, 400)  # fmt: skip
            elif self.path == "/destroy_weights_update_group":
                group = server.groups.pop(body["group_name"], None)
                if group is None:
                    return self._reply({"success": False, "message": "The group to be destroyed does not exist."}, 400)
                dist.destroy_process_group(group)
                print(f"destroyed group {body['group_name']}", flush=True)
            elif self.path == "/update_weights_from_distributed":
                server.update(body)
            elif self.path == "/update_weights_from_tensor":
                try:
                    server.update_from_tensor(body)
                except Exception as err:  # SGLang's scheduler does not catch it: the server ends
                    print(f"scheduler exception: {err}", flush=True)
                    self._reply({"success": False, "message": str(err)}, 500)
                    os._exit(1)
            elif self.path == "/begin_weight_update":
                with server.lock:
                    server.engine.begin_weight_update()
            elif self.path == "/end_weight_update":
                with server.lock:
                    server.engine.end_weight_update(full=True)
                    server.dump()
            elif self.path == "/flush_cache":
                if not server.paused and server.engine.num_unfinished():
                    return self._reply({"success": False, "message": "requests are running"}, 400)
            elif self.path == "/pause_generation":
                server.paused = True
            elif self.path == "/continue_generation":
                server.paused = False
            else:
                return self._reply({"error": f"no route {self.path}"}, 404)
            return self._reply(ok)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--custom-weight-loader", nargs="*", default=[])
    parser.add_argument("--json-model-override-args", default="{}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = Server(args.model, args.max_new_tokens, args.max_running, args.dump_dir, args.custom_weight_loader,
                    args.json_model_override_args)  # fmt: skip
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server))
    Path(args.port_file).write_text(str(httpd.server_address[1]))
    httpd.serve_forever()


if __name__ == "__main__":
    main()
