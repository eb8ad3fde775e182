"""The package layout holds: imports point down the layers with no circle, the rank side imports
nothing of the launcher side, the top level stays small, and the exit codes the docs show are the
ones the code uses."""

import ast
import re
from pathlib import Path

from conftest import REPO
from hvdkit import job
from hvdkit.system.launchers import BY_NAME

PACKAGE = REPO / "hvdkit"
# What runs inside every rank: it must start without the launcher's code, which may be absent
# from a rank's image and would pull the launch side's concerns into a rank.
RANK_SIDE = [*sorted((PACKAGE / "rank").rglob("*.py")), *sorted((PACKAGE / "checkpoint").glob("*.py")),
             *sorted((PACKAGE / "parallel").rglob("*.py")),
             *sorted((PACKAGE / "system").glob("*.py")), *(PACKAGE / name for name in (
                 "session.py", "trainer.py", "job.py", "data.py", "models.py", "config.py", "env.py", "nested.py"))]


def imported(path: Path) -> set:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return modules


# The rank side's packages, lowest first, as hvdkit/rank/__init__.py lists them: the run's state, then each
# concern on those before it, and the run's end over them all.
RANK_LAYERS = (
    ("hvdkit.rank", "hvdkit.rank.state", "hvdkit.rank.memory"),
    ("hvdkit.rank.agree",),
    ("hvdkit.rank.step",),
    ("hvdkit.rank.reports",),
    ("hvdkit.rank.liveness",),
    ("hvdkit.rank.ending",),
    ("hvdkit.rank.start",),
    ("hvdkit.rank.resume",),
    ("hvdkit.rank.finish", "hvdkit.rank.loggers"),  # loggers: the trackers' documented name, hvdkit.rank.reports'
)
# Lowest first: a module may import its own layer and those below. Commands -> Session/Trainer ->
# rank parts -> config, job, checkpoint; the tools above. A module's layer is its longest prefix.
LAYERS = (
    ("hvdkit", "hvdkit.job", "hvdkit.args", "hvdkit.config", "hvdkit.checkpoint", "hvdkit.env", "hvdkit.slurm",
     "hvdkit.models", "hvdkit.data"),
    ("hvdkit.parallel",),
    ("hvdkit.zero",),
    *RANK_LAYERS,
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
               "hvdkit.rank.memory": {"hvdkit.rank.step"}, "hvdkit.config": {"hvdkit.rank.loggers"},
               "hvdkit.rank.start.startup": {"hvdkit.rank.ending.lock", "hvdkit.rank.resume.checkpoints"}}
    assert circles(planted) == [["hvdkit.rank.memory", "hvdkit.rank.step", "hvdkit.zero.optimizer"]]
    assert upward(planted) == ["hvdkit.config -> hvdkit.rank.loggers", "hvdkit.rank.memory -> hvdkit.rank.step",
                               "hvdkit.rank.start.startup -> hvdkit.rank.resume.checkpoints",
                               "hvdkit.zero.optimizer -> hvdkit.rank.memory"]


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


EXIT_LIKE = {1, 2, *range(64, 79), *range(128, 166)}  # a failure, bad input, sysexits' range, 128 + a signal


def code_literals(source: str) -> list:
    """Exit codes written as numbers, or computed from 128, where a code is given: a ``return``, an
    ``exit``/``_exit`` call, an ``exit_code``/``code`` assignment. job.py's table names them all."""
    def numbers(expr) -> list:
        if isinstance(expr, ast.Constant) and type(expr.value) is int:
            return [expr.value]
        if isinstance(expr, ast.IfExp):
            return numbers(expr.body) + numbers(expr.orelse)
        if isinstance(expr, ast.BinOp):
            return [128] if 128 in numbers(expr.left) + numbers(expr.right) else []
        return []

    found = []
    for node in ast.walk(ast.parse(source)):
        given = []
        if isinstance(node, ast.Return) and node.value is not None:
            given = [node.value]
        elif isinstance(node, ast.Call) and node.args and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "exit", "_exit"):
            given = [node.args[0]]
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", getattr(t, "attr", "")) in ("exit_code", "code")
                                                  for t in node.targets):
            given = [node.value]
        if any(number in EXIT_LIKE for expr in given for number in numbers(expr)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_exit_codes_are_named_from_the_one_table():
    """A literal or computed code is one the table does not know it gives (spawn's 130, a
    launcher's 128 + n, a bench's private 75 were)."""
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted(PACKAGE.rglob("*.py")) if path.name != "job.py"
             for line in code_literals(path.read_text())]
    assert found == []


def test_the_code_check_finds_literals_and_computed_codes():
    planted = ("def f(x):\n    if x:\n        return 130\n    sys.exit(128 + x)\n"
               "def g(ok):\n    exit_code = 75\n    return 0 if ok else 1\n")
    assert sorted(line.split(":")[0] for line in code_literals(planted)) == ["3", "4", "6", "7"]
    assert code_literals("def f():\n    return job.stopped_by(2) if x else job.OK\n") == []


def test_one_of_each_lives_in_hvdkit_system():
    """Signal handlers (sighandlers.Handlers: nohup's SIGHUP kept), a whole file
    (wholefiles.write_whole) and a process tree's end (proctree.end_processes) each have one home,
    in hvdkit/system/. A loader worker ignores the stop signals for good (rank/start/loaders.py), which no
    handler restores."""
    patterns = {"signal.signal(": "sighandlers.Handlers", "os.replace(": "wholefiles.write_whole",
                "os.kill(": "proctree.end_processes"}
    homes = {"signal.signal(": "system/sighandlers.py", "os.replace(": "system/wholefiles.py",
             "os.kill(": "system/proctree.py"}
    allowed = {("rank/start/loaders.py", "signal.signal("),  # a worker's SIG_IGN, for good
               ("rank/agree/consistency.py", "os.replace("),  # checkpoints set aside: a move, not a write
               ("launch/spawn.py", "os.kill(")}  # the caller's own signal's default action, on itself
    found = sorted({f"{path.relative_to(PACKAGE)}: {pattern} (use {use})" for path in PACKAGE.rglob("*.py")
                    for pattern, use in patterns.items()
                    if pattern in path.read_text() and str(path.relative_to(PACKAGE)) != homes[pattern]
                    and (str(path.relative_to(PACKAGE)), pattern) not in allowed})
    assert found == []
    for pattern, use in patterns.items():
        name = use.split(".")[1]
        assert re.search(rf"^(def|class) {name}\b", (PACKAGE / homes[pattern]).read_text(), re.M), (use, homes[pattern])


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


def test_the_launchers_rank_variables_are_listed_once():
    """Which variable says a process is a rank, and which rank, is read from the launchers' table
    (hvdkit.system.launchers, through hvdkit.env) by every reader (the launcher's watch, the chaos
    rehearsal): two hand-made lists had drifted apart (one without PMIx's)."""
    names = {"HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "launchers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                listed = {e.value for e in node.elts if isinstance(e, ast.Constant)} & names
                if len(listed) >= 2:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {sorted(listed)}")
    assert found == []


RANK_CONCERNS = ("start", "step", "agree", "resume", "liveness", "ending", "reports")


def test_the_rank_side_is_laid_out_by_concern_and_each_package_names_its_modules():
    """A rank module sits in its concern's package (hvdkit/rank/__init__.py lists them), beside the
    run's state and memory peaks, the run's end over every concern and the loggers' documented name
    at the top; each package's docstring names every
    module in it, so that a reader finds where a thing is from the package alone."""
    rank = PACKAGE / "rank"
    assert sorted(p.name for p in rank.glob("*.py")) == ["__init__.py", "finish.py", "loggers.py", "memory.py",
                                                          "state.py"]
    assert sorted(p.name for p in rank.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(RANK_CONCERNS)
    listed = (rank / "__init__.py").read_text()
    unnamed = []
    for concern in RANK_CONCERNS:
        assert f"``{concern}/``" in listed, concern
        doc = ast.get_docstring(ast.parse((rank / concern / "__init__.py").read_text())) or ""
        unnamed += [f"{concern}/{module.stem}" for module in sorted((rank / concern).glob("*.py"))
                    if module.name != "__init__.py" and not re.search(rf"\b{module.stem}\b", doc)]
    assert unnamed == []


# Rank modules whose tests live with another module's: the line to the launcher is tested with its other end
# (hvdkit.launch.links), the run's end with every way a run ends.
TESTED_WITH = {"link": "tests/launch/test_links.py", "finish": "tests/rank/test_stops.py"}


def test_every_rank_module_has_a_test_file_of_its_own_that_names_it():
    """hvdkit/rank/<concern>/<module>.py is tested in tests/rank/test_<module>.py (or where TESTED_WITH
    says), whose docstring names the module, so that a module's tests are found from its name."""
    unfound = []
    for module in sorted((PACKAGE / "rank").rglob("*.py")):
        if module.name == "__init__.py":
            continue
        dotted = ".".join(module.relative_to(PACKAGE.parent).with_suffix("").parts)
        home = REPO / TESTED_WITH.get(module.stem, f"tests/rank/test_{module.stem}.py")
        doc = ast.get_docstring(ast.parse(home.read_text())) if home.exists() else None
        if doc is None or not re.search(rf"\b{re.escape(dotted)}\b", " ".join(doc.split())):
            unfound.append(f"{dotted}: {home.relative_to(REPO)}")
    assert unfound == [], "\n".join(unfound)


def launcher_names_compared(source: str) -> list[str]:
    """'line: name' for each launcher's name written as a string in a comparison (==, !=, in)."""
    names = set(BY_NAME)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found += [f"{node.lineno}: {item.value}" for item in items
                      if isinstance(item, ast.Constant) and item.value in names]
    return found


def test_a_launchers_facts_are_read_from_its_record():
    """What a launcher does (which to choose, its signals, its restarts, its processes) is read from
    hvdkit.system.launchers; `!= "srun"` and its like had spread over nine files."""
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "launchers.py" for line in launcher_names_compared(path.read_text())]
    assert found == []
    planted = 'if launcher == "srun" or name in ("mpirun", "x"):\n    pass\nif SRUN.name == launcher:\n    pass\n'
    assert launcher_names_compared(planted) == ["1: srun", "1: mpirun"]


MODULE_LINES = 500


def test_no_module_is_over_five_hundred_lines():
    """A module past 500 lines holds more than one role; split it by role (as bench/, rehearse/
    and zero/ were), not by cutting it in halves."""
    found = [f"{path.relative_to(REPO)}: {lines} lines" for path in sorted(PACKAGE.rglob("*.py"))
             if (lines := len(path.read_text().splitlines())) > MODULE_LINES]
    assert found == []


def test_the_session_delegates_in_at_most_400_lines_and_no_method_over_40():
    """The Session is a facade: a method that grows past 40 lines, or the whole past 400, is doing
    a part's work."""
    text = (PACKAGE / "session.py").read_text()
    assert len(text.splitlines()) <= 400
    tree = ast.parse(text)
    found = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 40]
    assert found == []


def test_the_trainer_imports_what_a_users_own_loop_could():
    """The Trainer is a loop over the Session: it reaches no rank part past it."""
    allowed = {"hvdkit.session", "hvdkit.config", "hvdkit.models", "hvdkit.data", "hvdkit.checkpoint"}
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / "trainer.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "hvdkit":  # from hvdkit import data
            found |= {f"hvdkit.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hvdkit"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hvdkit")}
    assert found and found - allowed == set()


def test_the_trainer_has_one_loop_and_the_session_makes_the_elastic_run():
    """Elastic or not, the Trainer's epochs are one loop, which Session.run runs: no second loop, no
    hand-set learning rate, no elastic API of Horovod's in the Trainer."""
    text = (PACKAGE / "trainer.py").read_text()
    tree = ast.parse(text)
    loops = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.For)
             and isinstance(node.target, ast.Name) and node.target.id == "batch"]
    assert len(loops) == 1, loops
    assert "hvd.elastic" not in text and 'group["lr"] =' not in text.split("def _continue_schedule")[0]


def test_only_the_checkpoint_package_writes_checkpoint_files():
    """One protocol for parts: a sharded checkpoint's parts and ZeRO's shards are written by the
    checkpoint package's writer, which alone writes checkpoint files."""
    calls = re.compile(r"checkpoint\.(write|save)\(|checkpoint\.writer\.")
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.parent.name != "checkpoint"
             for number, line in enumerate(path.read_text().splitlines(), 1) if calls.search(line)]
    assert found == []


def test_no_checkpoint_file_name_is_parsed_outside_its_writers():
    """A checkpoint's names (the file, its parts, ZeRO's shards among them) are made and read in the
    checkpoint package: any other module asks it (existing, step_of, step_in, part_name,
    rank_of_part, is_shard_folder) instead of matching names itself."""
    homes = {str(p.relative_to(PACKAGE)) for p in (PACKAGE / "checkpoint").glob("*.py")}
    names = re.compile(r"checkpoint\.(PREFIX|SUFFIX|SHARDS)\b|ckpt-step|(part|rank)-[^\s\"']*-of-")
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}" for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in homes
             for number, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
    assert found == []


def test_every_package_is_installed():
    """setup.cfg lists hvdkit's packages by hand: a package missing there imports in a checkout and
    is absent from a wheel or an image."""
    listed = set()
    lines = (REPO / "setup.cfg").read_text().split("packages =", 1)[1].splitlines()[1:]
    for line in lines:
        if not line.startswith((" ", "\t")) or not line.strip():
            break
        listed.add(line.strip())
    found = {".".join(path.parent.relative_to(REPO).parts) for path in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()


def test_tensors_nested_in_containers_are_walked_in_one_place():
    """Batches, checkpoints and compared states are walked by hvdkit/nested.py: a function of its
    own that recurses through dicts to reach tensors is a second walker to keep in step."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "nested.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            source = ast.unparse(node)
            recurses = any(isinstance(call, ast.Call) and getattr(call.func, "id", None) == node.name
                           for call in ast.walk(node))
            tensors = "Tensor" in source or "is_tensor" in source
            if recurses and "isinstance" in source and "dict" in source and tensors:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert found == []
