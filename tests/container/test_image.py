"""hvdkit's image, without an engine: the argument lists given to podman and docker (golden
files), the machine's pip settings handed to the build, the local base's key, and the one-line
refusals (no engine, an unknown one). The image built and run for real: tests/container/test_containers.py.

After changing an argument list, regenerate the golden file with `python tests/container/test_image.py`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from hvdkit.container import image
from hvdkit.container.engine import Engine, EngineError, Limits, Mount, find_engine

GOLDEN = REPO / "tests" / "golden" / "container-commands.json"
LIMITS = Limits(nofile=(20000, 20000), nproc=(32768, 32768))
ENGINES = {name: Engine(name=name, path=f"/usr/bin/{name}", limits=LIMITS) for name in ("podman", "docker")}
PIP_LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple https://mirror.example.com/simple'
global.find-links='/opt/old-wheels'
"""


def commands() -> dict:
    made = {}
    for name, engine in ENGINES.items():
        made[name] = {
            "build": engine.build(Path("/src/hvdkit"), "localhost/hvdkit:0.1.0-cpu",
                                  dockerfile=Path("/src/hvdkit/Dockerfile"), target="hvdkit",
                                  build_args={"BASE": "debian:bookworm", "PIP_FIND_LINKS": "/opt/wheels"},
                                  mounts=[Mount("/opt/wheels", "/opt/wheels", read_only=True)]),
            "run": engine.run("localhost/hvdkit:0.1.0-cpu", ["hvdkit", "doctor", "--selftest"], name="hvdkit-w0",
                              detach=True, network="hvdkit-net", hostname="worker-0",
                              mounts=[Mount("/tmp/ws", "/workspace")], env={"HVDKIT_LOG_DIR": "/workspace/runs/a"},
                              stop_timeout=30, labels={"hvdkit.job": "a"}),
            "stop": engine.stop(["hvdkit-launcher"], timeout=30),
            "save": engine.save("localhost/hvdkit:0.1.0-cpu", Path("/tmp/hvdkit.tar")),
        }
    return made


def test_engine_commands_match_golden():
    assert commands() == json.loads(GOLDEN.read_text())


def test_the_limits_handed_on_are_this_process_s_and_under_pid_max():
    limits = Limits.of_this_process()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert limits.nproc[1] <= pid_max and limits.nproc[0] <= limits.nproc[1]
    assert limits.nofile[0] <= limits.nofile[1]


def test_pip_settings_reach_the_build_with_local_folders_mounted_for_podman(tmp_path):
    settings = image.parse_pip_config(PIP_LISTING)
    assert settings["cert"] == "/etc/ssl/certs/ca-certificates.crt", "the environment's value wins, as in pip"
    assert settings["find-links"] == "/opt/wheels" and "constraint" not in settings
    here = {"/opt/wheels", "/opt/pypi", "/opt/pypi-more", "/etc/ssl/certs/ca-certificates.crt"}
    args, mounts, notes = image.pip_build_settings(settings, ENGINES["podman"], exists=here.__contains__)
    assert args == {"PIP_CERT": image.CERT_IN_BUILD, "PIP_FIND_LINKS": "/opt/wheels",
                    "PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple "
                                           "https://mirror.example.com/simple"}
    assert set(mounts) == {Mount("/etc/ssl/certs/ca-certificates.crt", image.CERT_IN_BUILD, True),
                           Mount("/opt/pypi", "/opt/pypi", True), Mount("/opt/pypi-more", "/opt/pypi-more", True),
                           Mount("/opt/wheels", "/opt/wheels", True)}
    assert notes == []


def test_docker_build_gets_the_remote_settings_and_a_note_for_local_folders():
    settings = image.parse_pip_config(PIP_LISTING)
    here = {"/opt/wheels", "/opt/pypi", "/opt/pypi-more"}
    args, mounts, notes = image.pip_build_settings(settings, ENGINES["docker"], exists=here.__contains__)
    assert args == {"PIP_EXTRA_INDEX_URL": "https://mirror.example.com/simple"} and mounts == []
    assert len(notes) == 2 and all("not visible to docker build" in note for note in notes)


def test_the_base_key_changes_with_what_goes_into_the_base(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text("Types: deb\nURIs: http://deb.debian.org/debian\n"
                                                                 "Suites: bookworm bookworm-updates\n")
    plan = image.plan_base(tmp_path)
    assert plan.sources.startswith("Types: deb") and plan.tag == f"localhost/hvdkit-base:bookworm-{plan.key}"
    assert image.BasePlan("bookworm", plan.sources, ("ca-certificates", "curl")).key != plan.key
    assert image.plan_base(tmp_path / "nothing").sources == "http://deb.debian.org/debian"
    assert plan.mmdebstrap(Path("/c/b.tar"), Path("/t/debian.sources")) == [
        "mmdebstrap", "--variant=minbase", "--quiet", "--include=ca-certificates", "bookworm", "/c/b.tar",
        "/t/debian.sources"]


def test_no_engine_or_an_unknown_one_is_one_line(tmp_path):
    with pytest.raises(EngineError, match="no container engine on PATH: install podman"):
        find_engine(environ={"PATH": str(tmp_path)})
    with pytest.raises(EngineError, match="docker is not on PATH"):
        find_engine("docker", environ={"PATH": str(tmp_path)})
    with pytest.raises(EngineError, match="unknown container engine 'lxc'"):
        find_engine(environ={"PATH": str(tmp_path), "HVDKIT_CONTAINER_ENGINE": "lxc"})
    done = subprocess.run([sys.executable, "-m", "hvdkit", "image", "build"], capture_output=True, text=True,
                          env={"PATH": str(tmp_path)})
    assert done.returncode == 1 and done.stderr == ("hvdkit image: no container engine on PATH: install podman "
                                                    "(Debian: apt-get install podman runc) or docker\n")


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(commands(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
