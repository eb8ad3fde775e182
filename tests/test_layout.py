"""The package layout holds: the rank side imports nothing of the launcher side, the top level
stays small, and the exit codes the docs show are the ones the code uses."""

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
