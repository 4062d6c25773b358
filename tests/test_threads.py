"""CPU threads: OpenMP's short spin and 2 MiB pages set by ``import triforce`` unless the user chose, and the
load-aware default thread count (``threads.py``, ``hugepages.py``), in subprocesses with a clean environment."""

import subprocess
import sys

import pytest

from support import clean_env
from triforce import TriForce


@pytest.mark.parametrize("preset,first,expect", [
    ({}, "", "None 10000"),                                     # triforce chooses before torch starts OpenMP
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "", "ACTIVE None"),         # the user's choice stands
    ({"GOMP_SPINCOUNT": "1000"}, "", "None 1000"),              # so does a spin count
    ({}, "import torch; ", "None None"),                        # too late once torch is loaded: left alone
])
def test_openmp_spin_is_short_unless_chosen(preset, first, expect):
    code = first + ("import os, triforce; "
                    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(**preset),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expect)

THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.parametrize("preset,expect", [({}, "1"), ({"THP_MEM_ALLOC_ENABLE": "0"}, "0")])
def test_huge_pages_are_on_unless_chosen(preset, expect):
    env = {k: v for k, v in clean_env().items() if k != "THP_MEM_ALLOC_ENABLE"} | preset
    out = subprocess.run([sys.executable, "-c", "import os, triforce; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = expect if sys.platform.startswith("linux") else str(preset.get("THP_MEM_ALLOC_ENABLE"))
    assert out.stdout.strip() == expected


def test_huge_pages_back_a_large_tensor():
    """After ``import triforce`` a 128 MiB tensor sits mostly on 2 MiB pages where the kernel gives them on
    ``madvise``; with ``THP_MEM_ALLOC_ENABLE=0`` it does not (under ``[madvise]``: ``[always]`` gives them anyway)."""
    try:
        with open(THP_MODE_FILE) as f:
            mode = f.read()
    except OSError:
        pytest.skip(f"no {THP_MODE_FILE}: not Linux, or no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine ([never])")
    code = ("import triforce, torch; t = torch.ones(32 << 20); "
            "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    huge = {}  # KiB of AnonHugePages, by setting
    for setting, extra in (("default", {}), ("0", {"THP_MEM_ALLOC_ENABLE": "0"})):
        env = {k: v for k, v in clean_env().items() if k != "THP_MEM_ALLOC_ENABLE"} | extra
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        huge[setting] = int(out.stdout.strip())
    assert huge["default"] >= 64 << 10, huge  # at least half of the 128 MiB
    if "[madvise]" in mode:
        assert huge["0"] < 64 << 10, huge


def test_default_threads_follow_the_affinity_mask():
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from triforce.kernels.threads import default_threads; print(default_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_python_api_threads(tiny_folder):
    import torch

    from triforce.kernels.threads import available_cpus

    try:
        TriForce.load(tiny_folder, threads="auto")
        assert 1 <= torch.get_num_threads() <= available_cpus()
    finally:
        TriForce.load(tiny_folder, threads=1)
    assert torch.get_num_threads() == 1
    for bad in (0, -1, 10**6, 1.5, True, "all"):
        with pytest.raises(ValueError, match="^threads must be an integer between 1 and .* or 'auto', got"):
            TriForce.load(tiny_folder, threads=bad)
    assert torch.get_num_threads() == 1


def test_idle_cpu_probe_sees_a_busy_core():
    """A busy loop on this process's only CPU leaves it (almost) no idle CPU: the default is then 1 thread."""
    code = ("import os, subprocess, sys, time; cpu = sorted(os.sched_getaffinity(0))[0]\n"
            "os.sched_setaffinity(0, {cpu})\n"
            "hog = subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(0.3)\n"
            "from triforce.kernels.threads import IdleCPUProbe, default_threads\n"
            "p = IdleCPUProbe(); idle = p.idle_cpus(min_window=1.0); hog.kill()\n"
            "print(idle, default_threads(idle))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    idle, threads = out.stdout.split()
    assert 0 <= float(idle) < 0.5 and threads == "1"


def test_default_threads_counts_cores_at_least_three_quarters_idle():
    from triforce.kernels.threads import available_cpus, default_threads

    assert default_threads(0.0) == default_threads(0.7) == 1
    assert default_threads(float(available_cpus())) == default_threads() >= 1
    assert default_threads(1.75) == min(2, default_threads())
