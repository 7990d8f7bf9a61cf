"""The engine table (rollout/engines.py, issue 37 item 4): what each rollout engine can do, read by the config
checks, the start-up checks and the planner, so that no file outside rollout/ branches on an engine's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.rollout.engines import ENGINES

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dapo"


def _engine_name_branches(tree: ast.AST) -> list[int]:
    """Lines comparing something named `engine` (rollout.engine, r.engine, engine) with an engine's name."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Attribute) and s.attr == "engine" or isinstance(s, ast.Name) and s.id == "engine"
                    for s in sides)  # fmt: skip
        constants = [s.value for s in sides if isinstance(s, ast.Constant)]
        constants += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.List)) for e in s.elts
                      if isinstance(e, ast.Constant)]  # fmt: skip
        if named and any(c in ENGINES for c in constants):
            lines.append(node.lineno)
    return lines


def test_no_file_outside_rollout_branches_on_an_engine_name():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "rollout" in path.relative_to(PACKAGE).parts:
            continue
        lines = _engine_name_branches(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert not found, f"branches on rollout.engine's value outside rollout/: {found}"
    assert _engine_name_branches(ast.parse('if rollout.engine == "sglang": pass'))  # the check sees one


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--rollout.engine=vllm", "--rollout.mode=server", "--rollout.server_urls=http://127.0.0.1:1"],
         'rollout.mode: "server" is not implemented for engine "vllm"'),
        (["--rollout.engine=vllm", "--rollout.weight_dtype=fp8"],
         'rollout.weight_dtype: "fp8" is implemented for engines "transformers", "colocated sglang", "server sglang", '
         "not vllm colocated"),
        (["--rollout.engine=vllm", "--actor.routing_replay=r3"],
         "actor.routing_replay: r3 needs every token's experts from the rollout engine; rollout.engine 'vllm' does "
         'not return them ("transformers", "colocated sglang", "server sglang" do); use r2'),
    ],
)  # fmt: skip
def test_the_config_checks_read_the_table(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert message in str(err.value), str(err.value)


def test_the_start_up_check_imports_the_package_the_table_names(monkeypatch):
    import importlib.util

    from megatron_dapo.launch import StartupError
    from megatron_dapo.launch import _check_engine

    looked: list[str] = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: looked.append(name))
    for engine, mode in (("transformers", "colocated"), ("sglang", "server")):  # nothing to import
        _check_engine(load_config(None, [f"--rollout.engine={engine}", f"--rollout.mode={mode}",
                                         "--rollout.server_urls=http://127.0.0.1:1"]).rollout)  # fmt: skip
    assert looked == []
    with pytest.raises(StartupError, match="rollout.engine=vllm, but the vllm package is not installed"):
        _check_engine(load_config(None, ["--rollout.engine=vllm"]).rollout)
    assert looked == ["vllm"]
