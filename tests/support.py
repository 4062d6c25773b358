"""Small helpers shared by tests: the environment of a subprocess that runs this worktree's sources, and draining a
generator to its return value."""

import os

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))


def source_env(**extra) -> dict:
    """This environment with the worktree's sources first on ``PYTHONPATH``, plus ``extra``."""
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def clean_env(**extra) -> dict:
    """This environment without the OpenMP wait settings, plus ``extra``; the worktree's sources first."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def drain(gen) -> tuple[list, object]:
    """``(the items gen yields, its return value)``, running it to the end."""
    items = []
    while True:
        try:
            items.append(next(gen))
        except StopIteration as stop:
            return items, stop.value
