"""The house rules of agent/ (STYLE.md, issues 9 and 27), checked on the source: folders in layers
(no import from a lower layer to a higher one), no module past 600 lines, no import cycle at module
level, no mixin and no stand-in method, every module in the README's layout, and the daemon
process never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

AGENT = Path(__file__).resolve().parents[1] / "agent"
#: "A module past ~600 lines is a sign it holds two nouns" (issue 27).
MAX_LINES = 600


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


#: agent/'s folders (and the top-level modules) from the lowest layer up: a module may import only
#: its own layer and those below it, anywhere in the file (a function-level import included; one
#: under ``if TYPE_CHECKING`` is a type, not a dependency). Where this order is broken the
#: architecture is: move the code, don't reorder the list.
LAYERS: list[tuple[str, ...]] = [
    ("util",),  # helpers that know nothing of the job: text, backoff, threads, logs, redaction
    ("install",),  # what is installed on this box: torch, LibreYOLO's command and options
    ("state", "staterecords", "events"),  # the run's lifecycle, its records, its event stream
    ("config",),  # the job file and the environment
    ("hub",),  # the one home of the Hugging Face Hub client
    ("sinks", "providers", "gpu"),  # the outside systems: sync targets, clouds, the driver
    ("preflight",),  # is this box fit: checks before anything is paid for in vain
    ("trainer",),  # the training process: launch, attach, wait, stop, warm start
    ("data",),  # the dataset: download, safe unpack, data YAML check
    ("watch", "policy"),  # what is watched while training runs; the rules that decide
    ("sync",),  # checkpoints off the box: snapshots, uploads, ledger, verification
    ("status",),  # what people see: /status, the page, metrics, notices, the post-mortem
    ("guard",),  # the process that outlives the agent and stops the box
    ("daemon",),  # the phases over one run context
    ("cli", "client", "logs", "demo", "entry", "supervise", "supervisor"),  # the commands
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str | None:
    """``agent.sync.engine`` -> ``sync``; ``agent.cli`` -> ``cli``; ``agent`` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "agent" else None


def all_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
        for node in ast.walk(top)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("agent.")}


def test_every_folder_and_top_module_has_a_layer() -> None:
    units = {p.name for p in AGENT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in AGENT.glob("*.py") if p.stem != "__init__"}
    assert units == set(RANK), (sorted(units - set(RANK)), sorted(set(RANK) - units))


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    upward = []
    for path in sorted(AGENT.rglob("*.py")):
        me = unit_of(module_name(path))
        if me is None:
            continue
        for target in sorted(all_imports(path)):
            them = unit_of(target)
            if them in RANK and RANK[them] > RANK[me]:
                upward.append(f"{path.relative_to(AGENT.parent)} ({me}) imports {target} ({them})")
    assert not upward, "\n".join(upward)


def test_no_module_is_a_mixin_and_no_method_is_a_stand_in() -> None:
    found = []
    for path in sorted(AGENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "Mixin" in node.name:
                found.append(f"{path.relative_to(AGENT.parent)}: class {node.name}")
            abstract = isinstance(node, ast.FunctionDef) and any(
                "abstractmethod" in ast.unparse(d) for d in node.decorator_list
            )
            if (
                isinstance(node, ast.FunctionDef)
                and not abstract
                and any(
                    isinstance(s, ast.Raise)
                    and isinstance(s.exc, ast.Name | ast.Call)
                    and "NotImplementedError" in ast.unparse(s.exc)
                    for s in node.body
                )
            ):
                found.append(
                    f"{path.relative_to(AGENT.parent)}: {node.name} raises NotImplementedError"
                )
    assert not found, "\n".join(found)


def test_the_readme_layout_is_the_tree() -> None:
    """The README's layout table names every module of agent/, under its folder, and no module
    that is gone; its rows are the layers above, lowest first."""
    readme = (AGENT.parent / "README.md").read_text()
    section = readme[readme.index("### Layout") :]
    rows = [r for r in section.split("\n\n")[2].splitlines()[2:] if r.startswith("| ")]
    named: set[str] = set()
    order: list[tuple[str, ...]] = []
    for row in rows:
        first, _what, modules = (c.strip() for c in row.strip("|").split(" | "))
        order.append(
            tuple(
                u.strip("`/").removeprefix("agent/").removesuffix(".py") for u in first.split(", ")
            )
        )
        named |= {f"agent/{m.strip('`')}" for m in modules.split(", ")}
    tree = {
        str(p.relative_to(AGENT.parent))
        for p in AGENT.rglob("*.py")
        if not (p.name == "__init__.py" and p.parent.parent == AGENT)
    } - {"agent/__init__.py"}
    assert sorted(tree - named) == [] and sorted(named - tree) == []
    assert order == LAYERS
