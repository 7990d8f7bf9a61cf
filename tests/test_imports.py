"""The package's import structure: every module imports alone in a fresh interpreter, the module graph (module-level
and function-local imports) has no cycle, and config.py imports no component (components register their names)."""

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_dapo"


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imports(module: str) -> set[str]:
    """megatron_dapo modules `module` imports anywhere in its file (a `from pkg import name` counts pkg.name when that
    is a module, else pkg)."""
    rel = Path(*module.split("."))
    path = ROOT / rel / "__init__.py" if (ROOT / rel).is_dir() else ROOT / rel.with_suffix(".py")
    known = set(_modules())
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megatron_dapo")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_dapo"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found - {module}


def test_config_imports_no_component():
    """Config names and checks its fields; the components register the names they own (config.register_choices).
    What it may import are declarations that import nothing of the package themselves (address rules, the engine
    table): no component, and nothing that could import config back."""
    allowed = {"megatron_dapo.net", "megatron_dapo.rollout.engines"}
    assert _imports("megatron_dapo.config") <= allowed
    for module in allowed:
        assert not _imports(module), f"{module} imports {sorted(_imports(module))}"


def test_module_graph_has_no_cycle():
    """No two modules import each other, directly or around a loop, not even from inside a function (the package
    __init__, the composition root that imports the registering components, is left out: Python runs it first)."""
    graph = {m: _imports(m) - {"megatron_dapo"} for m in _modules() if m != "megatron_dapo"}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # importing pkg.sub runs pkg/__init__ first: an edge to a package is an edge to its __init__
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else path + [nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module, [module])


_IMPORT_EACH = """
import importlib, sys, traceback
failed = []
for module in sys.argv[1:]:
    for name in [m for m in sys.modules if m == "megatron_dapo" or m.startswith("megatron_dapo.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except BaseException as err:
        failed.append(f"{module}: {type(err).__name__}: {err}".splitlines()[0])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    """Each module imported first, with no other module of the package loaded (as a user's script or a worker process
    imports it): two interpreters, each importing its half of the modules one after another and dropping every
    megatron_dapo module from sys.modules before the next (third-party packages stay loaded; they cannot hide an
    import-order problem of ours)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    modules = _modules()

    def run(part: list[str]) -> tuple[int, str]:
        cmd = [sys.executable, "-c", _IMPORT_EACH, *part]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        return proc.returncode, (proc.stdout.strip() or proc.stderr[-2000:]) if proc.returncode else ""

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, [modules[0::2], modules[1::2]]))
    failed = [out for rc, out in results if rc != 0]
    assert not failed, "\n".join(failed)
    assert len(modules) > 50


def _third_party(module: str) -> set[str]:
    """Top-level names of the packages outside megatron_dapo that `module` imports anywhere in its file."""
    rel = Path(*module.split("."))
    path = ROOT / rel / "__init__.py" if (ROOT / rel).is_dir() else ROOT / rel.with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found - {"megatron_dapo"}


def test_layers_import_only_downward():
    """The layering the design states (DESIGN.md, issue 37 item 3): algorithm and kernel code never imports megatron
    (parallelism reaches it as a group or a count); only actor/ imports megatron.core; actor/ imports nothing from
    rollout/, the placement, the generation or the trainer (the actor sits below them); rollout/ imports no trainer
    part."""
    modules = _modules()
    above_actor = {"megatron_dapo.rollout", "megatron_dapo.placement", "megatron_dapo.generation",
                   "megatron_dapo.trainer", "megatron_dapo.engine_rank", "megatron_dapo.cli"}  # fmt: skip
    trainer_parts = {"megatron_dapo.trainer", "megatron_dapo.generation", "megatron_dapo.engine_rank",
                     "megatron_dapo.placement", "megatron_dapo.cli"}  # fmt: skip
    problems = []
    for m in modules:
        if "megatron" in _third_party(m) and not m.startswith("megatron_dapo.actor"):
            problems.append(f"{m} imports megatron")
        if m.startswith("megatron_dapo.actor."):
            up = {i for i in _imports(m) if any(i == a or i.startswith(a + ".") for a in above_actor)}
            problems += [f"{m} imports {i}" for i in sorted(up)]
        if m.startswith("megatron_dapo.rollout."):
            up = {i for i in _imports(m) if i in trainer_parts}
            problems += [f"{m} imports {i}" for i in sorted(up)]
    assert not problems, problems
