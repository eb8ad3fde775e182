"""The package layout holds: imports point down the layers with no circle, the rank side imports
nothing of the launcher side, the top level stays small, and the exit codes the docs show are the
ones the code uses."""

import ast
import re
from pathlib import Path

from conftest import REPO
from hvdkit import job

PACKAGE = REPO / "hvdkit"
# What runs inside every rank: it must start without the launcher's code, which may be absent
# from a rank's image and would pull the launch side's concerns into a rank.
RANK_SIDE = [*sorted((PACKAGE / "rank").glob("*.py")), *(PACKAGE / name for name in (
    "session.py", "trainer.py", "job.py", "data.py", "models.py", "config.py", "checkpoint.py", "env.py"))]


def imported(path: Path) -> set:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return modules


# Lowest first: a module may import its own layer and those below. Commands -> Session/Trainer ->
# rank parts -> config, job, checkpoint; the tools above. A module's layer is its longest prefix.
LAYERS = (
    ("hvdkit", "hvdkit.job", "hvdkit.args", "hvdkit.config", "hvdkit.checkpoint", "hvdkit.env", "hvdkit.slurm",
     "hvdkit.models", "hvdkit.data"),
    ("hvdkit.zero",),
    ("hvdkit.rank",),
    ("hvdkit.session",),
    ("hvdkit.trainer",),
    ("hvdkit.launch",),  # the launcher's parts: plans, commands, hosts, supervision
    ("hvdkit.build", "hvdkit.checks"),
    ("hvdkit.launch.cli", "hvdkit.container", "hvdkit.rehearse"),  # `hvdkit launch` compares the hosts first
    ("hvdkit.bench",),
    ("hvdkit.plot",),
    ("hvdkit.cli", "hvdkit.__main__"),
)


def modules() -> dict:
    """hvdkit's modules by dotted name, each with its path."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict:
    """Each module's hvdkit imports, at any depth in the file (a lazy import is an import too)."""
    known = modules()

    def resolve(name: str):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {resolve(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets |= {resolve(f"{base}.{alias.name}") for alias in node.names}
        graph[name] = targets - {None, name}
    return graph


def circles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(name: str) -> int:
    matches = [(len(prefix), number) for number, prefixes in enumerate(LAYERS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} is in no layer: add it to LAYERS"
    return max(matches)[1]


def upward(graph: dict) -> list:
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if layer(target) > layer(source)]


def test_no_import_circle_and_every_import_points_down():
    graph = import_graph()
    assert circles(graph) == []
    assert upward(graph) == []


def test_the_layout_check_finds_a_planted_circle_and_an_upward_import():
    planted = {"hvdkit.rank.step": {"hvdkit.zero.optimizer"}, "hvdkit.zero.optimizer": {"hvdkit.rank.memory"},
               "hvdkit.rank.memory": {"hvdkit.rank.step"}, "hvdkit.config": {"hvdkit.rank.loggers"}}
    assert circles(planted) == [["hvdkit.rank.memory", "hvdkit.rank.step", "hvdkit.zero.optimizer"]]
    assert upward(planted) == ["hvdkit.config -> hvdkit.rank.loggers", "hvdkit.zero.optimizer -> hvdkit.rank.memory"]


def test_the_rank_side_imports_nothing_of_the_launcher_side():
    found = {str(path.relative_to(REPO)): sorted(m for m in imported(path) if m.startswith("hvdkit.launch"))
             for path in RANK_SIDE}
    assert {path: modules for path, modules in found.items() if modules} == {}


def test_the_top_level_holds_the_public_surface_only():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 14, modules


def test_the_docs_exit_code_table_is_the_code_one():
    text = (REPO / "docs" / "stops-and-recovery.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| code") and not line.startswith("| ---")]
    documented = [(re.sub(r" \+ n$", "", code), name, meaning, who) for code, name, meaning, who in rows]
    assert documented == [(str(e.code), e.name, e.meaning, e.who) for e in job.EXIT_CODES]


def test_exit_codes_are_named_from_the_one_table():
    """A literal 1 or 2 returned or exited with is a code the table does not know it gives."""
    literal = re.compile(r"(return|exit_code =) [12]( if|$)|exit\([12][,)]")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in sorted(PACKAGE.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert found == []


def test_no_part_holds_the_session_or_reads_its_private_attributes():
    """The Session's parts are handed what they use; a part reaching back through the Session
    (``session._checkpoints``) is the mesh this layout replaced."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "session.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "session"
                    and node.attr.startswith("_")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} session.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "proxy" and getattr(node.value, "id", "") == "weakref":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} weakref.proxy")
    assert found == []
