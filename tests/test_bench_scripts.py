"""bench/'s scripts (bench/README.md): every one starts from its group's folder (``--help``, so ``from common import``
finds bench/common.py), and bench/compare.py puts two result JSONs side by side, from files or from commits."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if "results" not in p.parts and p.name != "common.py")

#: runs each script as ``python SCRIPT --help`` would, in one process (one torch import for all of them): the
#: script's folder first on sys.path, bench/ not, and the modules the scripts import from beside them forgotten
#: between scripts
HELP_ALL = r"""
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    saved_path, saved_argv = list(sys.path), sys.argv
    sys.path.insert(0, path.rsplit("/", 1)[0])
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: no exit on --help")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{path}: exit {e.code}")
    except BaseException as e:
        failed.append(f"{path}: {type(e).__name__}: {e}")
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
        for name in ("common", "beyond", "serving_http"):
            sys.modules.pop(name, None)
print("\n".join(failed))
"""


def _compare():
    spec = importlib.util.spec_from_file_location("bench_compare", BENCH / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_starts_from_its_folder():
    out = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], cwd=ROOT / "tests",
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""


def test_compare_two_bench_jsons_by_method(capsys):
    compare = _compare()
    a = RESULTS / "speed_default_avx2" / "pg1342_8000_t06.json"
    b = RESULTS / "speed_default" / "pg1342_8000_t06.json"
    assert compare.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"A: {a}") and out[1].startswith(f"B: {b}")
    ms_a = json.loads(a.read_text())["methods"]["auto"]["mean_time_between_tokens_ms"]["median"]
    ms_b = json.loads(b.read_text())["methods"]["auto"]["mean_time_between_tokens_ms"]["median"]
    row = next(x for x in out if x.startswith("auto ms/token")).split()
    assert [float(row[-3]), float(row[-2]), float(row[-1])] == pytest.approx([ms_a, ms_b, ms_b / ms_a], rel=1e-3)


def test_compare_flattens_any_json(capsys):
    compare = _compare()
    a = {"x": 2, "steps": {"d": {"ms": 4.0}}, "ids": list(range(50)), "ok": True}
    b = {"x": 3, "steps": {"d": {"ms": 2.0}}}
    assert compare.compare(a, b) == [("x", 2.0, 3.0, 1.5), ("steps.d.ms", 4.0, 2.0, 0.5)]
    rows = compare.compare(json.loads((RESULTS / "rows.json").read_text()),
                           json.loads((RESULTS / "rows_avx2_cpu.json").read_text()))
    assert ("context", 8000.0, 8000.0, 1.0) in rows and any(k.endswith("ours_ms") for k, *_ in rows)


def test_compare_reads_a_result_at_two_commits(capsys):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=False).returncode != 0:
        pytest.skip("not a git checkout")
    compare = _compare()
    path = "bench/results/qlinear.json"
    committed = subprocess.run(["git", "cat-file", "-e", f"HEAD:{path}"], cwd=ROOT, capture_output=True, check=False)
    if committed.returncode != 0:
        pytest.skip(f"{path} is not committed")
    assert compare.main(["--commits", "HEAD", "HEAD", "--result", str(ROOT / path)]) == 0
    out = capsys.readouterr().out
    assert "results[0].ours_int8.ms" in out and " 1.000" in out
    assert compare.main(["--commits", "HEAD", "no-such-commit", "--result", str(ROOT / path)]) == 1
