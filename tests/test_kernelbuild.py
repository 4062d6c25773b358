"""Kernel builds that survive real installations (kernelbuild.py): libraries every user can load, one compile for
concurrent first uses, the next directory where the cache cannot be written, the next build where the compiler
rejects a build's flags."""

import ctypes
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from triforce.kernels.build import _build, _Library, _load_built, best_build, kernel_dirs

FLAGS = ("-O1", "-shared", "-fPIC")

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture
def probe_source(tmp_path):
    """A one-function C file, unique per test (its hash names the build)."""
    src = tmp_path / "probe.c"
    src.write_text(f"int triforce_probe(void) {{ return {abs(hash(str(tmp_path))) % 1000}; }}\n")
    return src


def _counting_cc(tmp_path, refuse_avx512: bool = False, sleep: float = 0.0):
    """A compiler wrapper that logs each call to ``cc.log`` (and refuses ``-mavx512*`` flags if asked)."""
    log, cc = tmp_path / "cc.log", tmp_path / "cc.sh"
    real = shutil.which("cc") or shutil.which("gcc")
    refuse = ('case "$*" in *-mavx512*) echo "cc: error: unrecognized option -mavx512f" >&2; exit 1;; esac'
              if refuse_avx512 else '')
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {log}
        {refuse}
        sleep {sleep}
        exec {real} "$@"
        """))
    cc.chmod(0o755)
    return str(cc), log


def test_a_built_library_is_readable_and_loadable_by_every_user(tmp_path, probe_source):
    lib = _build(tmp_path / "kernels", probe_source, FLAGS)
    assert stat.S_IMODE(lib.stat().st_mode) == 0o755  # mkstemp's 0600 would refuse another user's dlopen
    assert ctypes.CDLL(str(lib)).triforce_probe() == int(probe_source.read_text().split("return ")[1].split(";")[0])
    assert _build(tmp_path / "kernels", probe_source, FLAGS) == lib  # kept: not rebuilt


def test_concurrent_first_uses_compile_once(tmp_path, probe_source):
    cc, log = _counting_cc(tmp_path, sleep=1.0)
    code = (f"from pathlib import Path; from triforce.kernels.build import _build; "
            f"print(_build(Path({str(tmp_path / 'kernels')!r}), Path({str(probe_source)!r}), {FLAGS!r}))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "CC": cc}) for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and os.path.exists(paths.pop())
    assert len(log.read_text().splitlines()) == 1  # one compile, the other two waited for it


def test_an_unusable_cache_directory_falls_back_to_a_per_user_temporary_one(tmp_path, probe_source, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("TRIFORCE_CACHE", str(blocker))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    first, fallback = kernel_dirs()
    assert first == blocker / "kernels" and fallback.parent == tmp_path / "tmp"
    lib = _load_built(probe_source, FLAGS)
    assert lib.triforce_probe() >= 0
    assert [p.parent for p in fallback.glob("probe-*.so")] == [fallback]


def test_a_compiler_rejecting_avx512_flags_gets_the_avx2_build(tmp_path, monkeypatch):
    from triforce.kernels import cpu as kernels

    if "AVX-512" not in kernels.cpu()["isa"]:
        pytest.skip("the CPU has no AVX-512: its best build is already the AVX2 one")
    cc, log = _counting_cc(tmp_path, refuse_avx512=True)
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    lib = _Library("qlinear.c", "TRIFORCE_LINEAR_KERNEL", ("avx2", "fma"), lambda: best_build(kernels._LINEAR_BUILDS),
                   kernels._LINEAR_SYMBOLS, kernels._LINEAR_BUILDS)
    assert lib.load() is not None
    assert lib.status.startswith("on (csrc/qlinear.c, AVX2; the AVX-512 build failed to compile"), lib.status
    assert "unrecognized option" in lib.status
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "-mavx512f" in calls[0] and "-mavx512f" not in calls[1]


def test_a_compiler_rejecting_every_build_leaves_the_kernel_off_with_each_reason(tmp_path, monkeypatch):
    cc, _ = _counting_cc(tmp_path)
    (tmp_path / "cc.sh").write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    lib = _Library("norm_rope.c", "TRIFORCE_NORM_ROPE_KERNEL", (), lambda: (FLAGS, "plain"), {"x": (None, [])})
    with pytest.warns(RuntimeWarning, match="csrc/norm_rope.c is off, PyTorch's ops run instead"):
        assert lib.load() is None
    assert lib.load() is None  # no second warning: the status is kept
    assert lib.status.startswith("unavailable: the plain build failed to compile") and "internal error" in lib.status


def test_the_isa_variable_forces_the_portable_build_and_rejects_other_values(monkeypatch):
    """TRIFORCE_KERNEL_ISA=portable hides every AVX flag, FMA and F16C, so each kernel's choice is its portable build
    (plain C, no ISA flags), as on a CPU without AVX2 or on aarch64; another value is a ValueError listing the allowed
    ones."""
    from triforce.kernels import blockcodes, sampling
    from triforce.kernels import cpu as kernels
    from triforce.kernels.build import ISA_ENV, _cpu_flags

    monkeypatch.setenv(ISA_ENV, "portable")
    assert not {f for f in _cpu_flags() if f.startswith(("avx", "fma", "f16c"))}
    assert kernels.cpu()["isa"] == "portable"
    for builds in (kernels._ATTENTION_BUILDS, kernels._LINEAR_BUILDS, kernels._NORM_ROPE_BUILDS, blockcodes._BUILDS,
                   sampling._BUILDS):
        flags, name = best_build(builds)
        assert name == "portable" and not any(f.startswith("-m") for f in flags), (name, flags)
    monkeypatch.setenv(ISA_ENV, "SSE2")
    with pytest.raises(ValueError, match="TRIFORCE_KERNEL_ISA must be 'AVX2', 'portable' or unset, got 'SSE2'"):
        _cpu_flags()


def test_a_compiler_rejecting_every_isa_flag_gets_the_portable_build(tmp_path, monkeypatch):
    """A compiler that refuses -mavx2 and -mavx512* (one for another architecture, say) still builds every kernel's
    portable branch: the next build after AVX-512 and AVX2, named in the status with the first refusal."""
    from triforce.kernels import cpu as kernels

    log, real = tmp_path / "cc.log", shutil.which("cc") or shutil.which("gcc")
    cc = tmp_path / "cc.sh"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                  'case "$*" in *-mavx*) echo "cc: error: unrecognized option -mavx2" >&2; exit 1;; esac\n'
                  f'exec {real} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    lib = _Library("qlinear.c", "TRIFORCE_LINEAR_KERNEL", (), lambda: best_build(kernels._LINEAR_BUILDS),
                   kernels._LINEAR_SYMBOLS, kernels._LINEAR_BUILDS)
    assert lib.load() is not None
    assert lib.status.startswith("on (csrc/qlinear.c, portable"), lib.status
    if kernels.cpu()["isa"] != "portable":  # a build with ISA flags was tried first
        assert "build failed to compile" in lib.status and "unrecognized option -mavx" in lib.status
    assert "-mavx" not in log.read_text().splitlines()[-1]
