"""The house rules of agent/ (STYLE.md, issue 9), checked on the source: no module past ~700
lines, no import cycle at module level, and the daemon process never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

AGENT = Path(__file__).resolve().parents[1] / "agent"
#: "A module past ~700 lines is a sign it holds two nouns": a little slack, not a second noun.
MAX_LINES = 750


def module_name(path: Path) -> str:
    parts = path.relative_to(AGENT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of ours imported at module level (TYPE_CHECKING blocks and local imports are
    not cycles at import time)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            targets = [mod, *(f"{mod}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_module_is_past_the_size_of_one_noun() -> None:
    big = {
        str(p.relative_to(AGENT.parent)): n
        for p in AGENT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, big


def test_no_import_cycle() -> None:
    paths = {module_name(p): p for p in AGENT.rglob("*.py")}
    graph = {m: module_imports(p, m, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append([*stack[stack.index(v) :], v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_the_daemon_side_never_imports_torch() -> None:
    code = (
        "import sys, agent.cli, agent.daemon.spine, agent.guard.run, agent.preflight, "
        "agent.data.dataset; "
        "print(sorted(m for m in ('torch', 'libreyolo', 'torchvision') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
