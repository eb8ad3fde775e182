"""The docs say only what is true: every relative link and anchor resolves, and every flag an
`hvdkit ...` command line in them names is one that command's --help lists."""

import functools
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PATCHES = sorted((REPO / "hvdkit" / "build" / "patches").glob("*.patch"))  # their headers name tests
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
# Flags `hvdkit launch` hands to the launcher as given (its --help says so): the launchers' own.
LAUNCHER_FLAGS = {"--bind-to", "--map-by", "--host-discovery-script", "--min-np", "--max-np", "--mca",
                  "--tag-output", "--timestamp-output", "--output-filename", "--network-interface",
                  "--start-timeout", "--verbose", "--log-level", "--elastic-timeout", "--reset-limit",
                  "--blacklist-cooldown-range", "--disable-cache", "--report-bindings"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set:
    found, seen = set(), {}
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", body, re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def link_problems(page: Path, text: str) -> list:
    problems = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            problems.append(f"{page.name}: {target}: no such anchor")
    return problems


REPO_PATH = re.compile(r"(?<![\w/.])((?:tests|hvdkit|slurm|launchers|docs)/[\w./-]*\w\.(?:py|md|sbatch|sh|patch))")


def path_problems(page_name: str, text: str) -> list:
    """Files of this repository a page names in its text (tests/rank/test_stops.py): each exists."""
    return [f"{page_name}: {path}: no such file" for path in sorted(set(REPO_PATH.findall(text)))
            if not (REPO / path).exists()]


@functools.lru_cache(maxsize=None)
def help_text(words: tuple) -> str:
    proc = subprocess.run([sys.executable, "-m", "hvdkit", *words, "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    return proc.stdout if proc.returncode == 0 else ""


def command_lines(text: str):
    """Each `hvdkit ...` command in the code of a page: its words up to the end of its line or its
    `--` (what follows is the ranks' command, checked on its own when it is hvdkit's)."""
    for block, inline in CODE.findall(text):
        code = (block or inline).replace("\\\n", " ")
        for line in code.splitlines():
            for part in re.split(r"(?:^|\s)(?=hvdkit\s)", line)[1:]:
                words = re.split(r"\s+(?:--|\||&&|;|>)(?:\s|$)", part)[0].split()
                if len(words) > 1 and words[0] == "hvdkit":
                    yield words[1:]


def flag_problems(page_name: str, text: str) -> list:
    problems = []
    for words in command_lines(text):
        path = []
        for word in words:
            if word.startswith("-") or not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            path.append(word)
        while path and not help_text(tuple(path)):
            path.pop()
        if not path:
            continue
        listed = help_text(tuple(path))
        for word in words[len(path):]:
            flag = word.split("=")[0]
            if not re.fullmatch(r"--?[a-z][a-z0-9-]*", flag) or flag in ("-h", "--help"):
                continue
            if path[0] == "launch" and flag in LAUNCHER_FLAGS:
                continue
            if not re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", listed, re.M):
                problems.append(f"{page_name}: hvdkit {' '.join(path)} {flag}: not in its --help")
    return problems


def test_every_relative_link_and_anchor_resolves():
    assert [problem for page in PAGES for problem in link_problems(page, page.read_text())] == []


def test_every_file_the_docs_name_exists():
    assert [problem for page in [*PAGES, *PATCHES] for problem in path_problems(page.name, page.read_text())] == []


def test_every_flag_the_docs_name_is_in_the_commands_help():
    assert [problem for page in PAGES for problem in flag_problems(page.name, page.read_text())] == []


def test_the_docs_checks_find_a_planted_dead_anchor_missing_file_and_unknown_flag():
    page = REPO / "docs" / "training.md"
    planted = "See [stops](stops-and-recovery.md#no-such-section) and [exit codes](stops-and-recovery.md#exit-codes)."
    assert link_problems(page, planted) == ["training.md: stops-and-recovery.md#no-such-section: no such anchor"]
    assert path_problems("x.md", "checked by tests/test_stops.py and tests/rank/test_stops.py") == [
        "x.md: tests/test_stops.py: no such file"]
    assert flag_problems("x.md", "Run `hvdkit bench synthetic --rate 10gbit --model resnet18`.") == [
        "x.md: hvdkit bench synthetic --rate: not in its --help"]
