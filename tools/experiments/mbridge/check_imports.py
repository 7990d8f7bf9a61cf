# ruff: noqa: E501  (an exploratory script: imports staged to show where each failure happens)
"""Check every megatron import made by mbridge against the installed megatron.core (AST walk)."""

import ast
import importlib
import pathlib
import warnings

warnings.filterwarnings("ignore")
root = pathlib.Path(__import__("mbridge").__file__).parent
rows = []
for f in sorted(root.rglob("*.py")):
    tree = ast.parse(f.read_text())
    parents = {}
    for node in ast.walk(tree):
        for ch in ast.iter_child_nodes(node):
            parents[ch] = node
    for node in ast.walk(tree):
        in_try = False
        p = parents.get(node)
        while p is not None:
            if isinstance(p, ast.Try):
                in_try = True
                break
            p = parents.get(p)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron"):
            for a in node.names:
                rows.append((f.relative_to(root.parent), node.lineno, node.module, a.name, in_try))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megatron"):
                    rows.append((f.relative_to(root.parent), node.lineno, a.name, None, in_try))
ok = fail = 0
fails = []
for path, line, mod, name, in_try in rows:
    try:
        m = importlib.import_module(mod)
        if name is not None and name != "*":
            if not hasattr(m, name):
                importlib.import_module(f"{mod}.{name}")
        ok += 1
    except Exception as e:
        fail += 1
        fails.append(
            f"{path}:{line}  from {mod} import {name}  [{'inside try' if in_try else 'UNGUARDED'}]  -> {type(e).__name__}: {str(e).splitlines()[0][:110]}"
        )
print(
    f"megatron imports checked: {len(rows)} ({len(set((m, n) for _, _, m, n, _ in rows))} distinct); ok={ok} fail={fail}"
)
print("\n".join(fails))
