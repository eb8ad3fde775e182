"""The builder's decisions, tested as pure functions: no compiler runs here."""

from pathlib import Path

import pytest

from hvdkit.build import builder as build
from hvdkit.build import patches, toolchain
from hvdkit.build.builder import BuildError, Toolchain, plan_build


@pytest.mark.parametrize("torch_version, standard", [
    ("1.13.1", 14),
    ("2.0.1+cu118", 14),
    ("2.1.0", 17),
    ("2.13.0+cpu", 17),
    ("2.14.0", 20),
    ("2.14.1+cu130", 20),
    ("3.0.0", 20),
])
def test_cxx_standard_follows_torch(torch_version, standard):
    assert build.cxx_standard_for_torch(torch_version) == standard


def test_unreadable_version_is_one_clear_error():
    with pytest.raises(BuildError, match="cannot read a version"):
        build.cxx_standard_for_torch("nightly")


def _gpu_toolchain(**overrides):
    fields = dict(torch_version="2.14.1+cu130", torch_cuda="13.0", python_tag="cp311",
                  cuda_home=Path("/usr/local/cuda-13.0"), cuda_version="13.0",
                  nccl_include=Path("/site/nvidia/nccl/include"),
                  nccl_library=Path("/site/nvidia/nccl/lib/libnccl.so.2"), nccl_version="2.30.7")
    fields.update(overrides)
    return Toolchain(**fields)


CONTROLLER_FLAGS = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITHOUT_TENSORFLOW": "1",
                    "HOROVOD_WITHOUT_MXNET": "1", "HOROVOD_WITH_MPI": "1", "HOROVOD_WITH_GLOO": "1"}


def test_nccl_when_toolkit_and_headers_are_found():
    plan = plan_build(_gpu_toolchain())
    assert plan.gpu_operations == "NCCL"
    assert plan.flags == {**CONTROLLER_FLAGS, "HOROVOD_GPU_OPERATIONS": "NCCL"}
    assert plan.paths == {"CUDA_HOME": "/usr/local/cuda-13.0", "HOROVOD_CUDA_HOME": "/usr/local/cuda-13.0",
                          "HOROVOD_NCCL_INCLUDE": "/site/nvidia/nccl/include",
                          "HOROVOD_NCCL_LIB": "/site/nvidia/nccl/lib"}
    assert plan.cxx_standard == 20


@pytest.mark.parametrize("overrides, reason", [
    ({"torch_cuda": None}, "torch is a CPU-only build"),
    ({"cuda_home": None, "cuda_version": None}, "no CUDA toolkit"),
    ({"nccl_include": None, "nccl_library": None}, "no NCCL headers"),
    ({"cuda_version": "12.8"}, "does not match torch's CUDA 13.0"),
])
def test_cpu_only_build_says_why(overrides, reason):
    plan = plan_build(_gpu_toolchain(**overrides))
    assert plan.gpu_operations is None
    assert plan.flags == CONTROLLER_FLAGS
    assert plan.paths == {}
    assert reason in plan.gpu_reason
    assert any(reason in line for line in plan.describe())


def test_cpu_only_on_request():
    """No NCCL; with torch's CUDA build and a toolkit, Horovod's torch extension still compiles its
    CUDA support, so the toolkit's home goes to CMake (without it: cudart NOTFOUND, seen)."""
    plan = plan_build(_gpu_toolchain(), cpu_only=True)
    assert plan.gpu_operations is None and "requested" in plan.gpu_reason
    assert "HOROVOD_GPU_OPERATIONS" not in plan.flags and "HOROVOD_NCCL_INCLUDE" not in plan.paths
    assert plan.paths["CUDA_HOME"] == plan.paths["HOROVOD_CUDA_HOME"] == str(_gpu_toolchain().cuda_home)
    assert plan_build(_gpu_toolchain(cuda_home=None), cpu_only=True).paths == {}


def test_cache_key_changes_with_what_changes_the_binary():
    base = plan_build(_gpu_toolchain())
    assert plan_build(_gpu_toolchain()).key == base.key
    # Paths do not change the binary's identity.
    assert plan_build(_gpu_toolchain(cuda_home=Path("/opt/cuda"))).key == base.key
    others = [
        plan_build(_gpu_toolchain(torch_version="2.14.0+cu130")),
        plan_build(_gpu_toolchain(python_tag="cp312")),
        plan_build(_gpu_toolchain(), cpu_only=True),
        plan_build(_gpu_toolchain(nccl_version="2.31.0")),
        plan_build(_gpu_toolchain(mpi="none", mpicxx=None)),
    ]
    keys = {p.key for p in others}
    assert base.key not in keys and len(keys) == len(others)
    assert base.key.startswith("horovod0.28.1-torch2.14.1_cu130-cp311-")
    assert base.local_version == f"0.28.1+hvdkit.{base.digest}"


def test_describe_prints_flags():
    text = "\n".join(plan_build(_gpu_toolchain()).describe())
    assert "C++20" in text and "HOROVOD_GPU_OPERATIONS=NCCL" in text and "controllers: MPI (Open MPI), Gloo" in text


def test_without_mpi_builds_gloo_only_and_says_so():
    plan = plan_build(_gpu_toolchain(mpi="none", mpicxx=None))
    assert plan.flags["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in plan.flags
    assert "MPICXX" not in plan.paths and plan.gpu_operations == "NCCL"
    assert "controllers: Gloo (no MPI: --mpi none)" in plan.describe()
    assert toolchain.find_mpicxx("none", lambda name: "/usr/bin/mpicxx", lambda path: "") == ("none", None)


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_cuda_home_skips_a_directory_with_only_bin(tmp_path):
    bare = tmp_path / "cuda"
    _touch(bare / "bin" / "nvcc")
    full = tmp_path / "cuda-13.0"
    _touch(full / "bin" / "nvcc")
    _touch(full / "include" / "cuda_runtime.h")
    assert toolchain.find_cuda_home({"CUDA_HOME": str(bare), "CUDA_PATH": str(full)}, None) == full
    assert toolchain.find_cuda_home({}, str(full / "bin" / "nvcc")) == full


def test_cuda_home_prefers_horovods_variable(tmp_path):
    homes = []
    for name in ("a", "b"):
        _touch(tmp_path / name / "bin" / "nvcc")
        _touch(tmp_path / name / "include" / "cuda_runtime.h")
        homes.append(tmp_path / name)
    assert toolchain.find_cuda_home({"CUDA_HOME": str(homes[0]), "HOROVOD_CUDA_HOME": str(homes[1])}, None) == homes[1]


NCCL_H = "#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n#define NCCL_PATCH 7\n"


def test_find_nccl_in_a_wheel_layout(tmp_path):
    wheel = tmp_path / "site" / "nvidia" / "nccl"
    _touch(wheel / "include" / "nccl.h", NCCL_H)
    lib = _touch(wheel / "lib" / "libnccl.so.2")
    headers_only = tmp_path / "headers-only"
    _touch(headers_only / "include" / "nccl.h", NCCL_H)
    assert toolchain.find_nccl([tmp_path / "missing", headers_only, wheel]) == (wheel / "include", lib)
    assert toolchain.find_nccl([headers_only]) is None
    assert toolchain.nccl_version_from_header(NCCL_H) == "2.30.7"
    assert toolchain.nccl_version_from_header("#define NCCL_MAJOR 2\n") is None


def test_the_cxx_standard_patch_comes_first_and_the_fixes_in_order():
    fixes = sorted(patches.FOLDER.glob("0*.patch"))
    assert [p.name for p in fixes][:3] == ["0001-torch-synchronize-sleeps-until-done.patch",
                                           "0002-gloo-float16-sum-with-f16c.patch",
                                           "0003-idle-background-thread-sleeps.patch"]
    assert patches.for_standard(14) == fixes  # Horovod's own standard
    for standard in (17, 20):
        assert patches.for_standard(standard) == [patches.FOLDER / f"cxx-standard-{standard}.patch", *fixes]


def test_every_patch_says_what_it_fixes_before_its_diff():
    for patch in patches.FOLDER.glob("*.patch"):
        header = patch.read_text().split("\n--- a/", 1)[0]
        assert len(header.splitlines()) >= 4 and "Upstream:" in header, patch.name


def _patch_folder(tmp_path, monkeypatch, text):
    folder = tmp_path / "patches"
    folder.mkdir()
    (folder / "0001-two.patch").write_text(text)
    monkeypatch.setattr(patches, "FOLDER", folder)
    return folder


TWO_PATCH = "Why: two is 2.\n\n--- a/a.cc\n+++ b/a.cc\n@@ -1,3 +1,3 @@\n one\n-two\n+2\n three\n"


def test_patches_apply_in_order_with_gnu_patch(tmp_path, monkeypatch):
    _patch_folder(tmp_path, monkeypatch, TWO_PATCH)
    source = _touch(tmp_path / "src" / "a.cc", "one\ntwo\nthree\n")
    patches.apply(tmp_path / "src", patches.for_standard(14))
    assert source.read_text() == "one\n2\nthree\n"


@pytest.mark.parametrize("text", ["one\nthree\n", "one\n2\nthree\n", "zero\none\ntwo\nthree!\n"])
def test_a_patch_that_does_not_apply_exactly_stops_the_build_and_changes_nothing(tmp_path, monkeypatch, text):
    _patch_folder(tmp_path, monkeypatch, TWO_PATCH)
    source = _touch(tmp_path / "src" / "a.cc", text)
    with pytest.raises(BuildError, match=r"0001-two.patch does not apply to .*src \(.+\); is this Horovod 0.28.1\?"):
        patches.apply(tmp_path / "src", patches.for_standard(14))
    assert source.read_text() == text and sorted(p.name for p in (tmp_path / "src").iterdir()) == ["a.cc"]


def test_the_cache_key_follows_the_patches(tmp_path, monkeypatch):
    before = plan_build(_gpu_toolchain()).key
    folder = tmp_path / "copy"
    folder.mkdir()
    for patch in patches.FOLDER.glob("*.patch"):
        (folder / patch.name).write_bytes(patch.read_bytes())
    monkeypatch.setattr(patches, "FOLDER", folder)
    assert plan_build(_gpu_toolchain()).key == before  # the same patches, elsewhere
    fix = folder / "0002-gloo-float16-sum-with-f16c.patch"
    fix.write_text("A corrected header line.\n" + fix.read_text().replace("(tests/", "(see tests/", 1))
    assert plan_build(_gpu_toolchain()).key == before  # a header is not built
    fix.write_text(fix.read_text() + "\n")
    assert plan_build(_gpu_toolchain()).key != before
    fix.unlink()
    assert plan_build(_gpu_toolchain()).key != before


BUILD_LOG = """\
-- Configuring done
[ 40%] Building CXX object horovod/torch/CMakeFiles/pytorch.dir/mpi_ops_v2.cc.o
In file included from /site/torch/include/c10/util/Half.h:14,
/site/torch/include/c10/core/SymInt.h:41:8: error: 'strong_ordering' in namespace 'std' does not name a type
   41 |   std::strong_ordering operator<=>(const SymInt&) const;
/site/torch/include/c10/core/SymInt.h:50:3: error: expected ';' before '}' token
make[2]: *** [horovod/torch/CMakeFiles/pytorch.dir/build.make:76: mpi_ops_v2.cc.o] Error 1
  error: subprocess-exited-with-error
  note: This error originates from a subprocess
  ERROR: Failed building wheel for horovod
"""


def test_first_errors_shows_the_compilers_lines_not_pips():
    lines = build.first_errors(BUILD_LOG)
    assert lines[0].endswith("'strong_ordering' in namespace 'std' does not name a type")
    assert lines[1].strip().startswith("41 |")
    assert any("Error 1" in line for line in lines)
    assert not any("subprocess-exited-with-error" in line or "Failed building" in line for line in lines)
    assert build.first_errors("all good\n") == []


def test_cuda_kernels_are_built_for_torchs_architectures_unless_told():
    """Horovod alone compiles its kernels for every architecture nvcc knows (twelve with CUDA 13):
    488 s of a fresh clone's build here (issue 49), against 255 s for torch's six."""
    flags = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120"
    assert toolchain.cuda_archs({}, flags) == "75,80,86,90,100,120"
    assert toolchain.cuda_archs({"HOROVOD_BUILD_CUDA_CC_LIST": "90"}, flags) == "90"
    assert toolchain.cuda_archs({}, "") == ""
    plan = plan_build(_gpu_toolchain(cuda_archs="75,80"))
    assert plan.flags["HOROVOD_BUILD_CUDA_CC_LIST"] == "75,80"
    assert plan.key != plan_build(_gpu_toolchain(cuda_archs="90")).key
    assert plan_build(_gpu_toolchain(cuda_archs="75"), cpu_only=True).flags["HOROVOD_BUILD_CUDA_CC_LIST"] == "75"
    assert "HOROVOD_BUILD_CUDA_CC_LIST" not in plan_build(_gpu_toolchain(cuda_archs="75", torch_cuda=None)).flags
