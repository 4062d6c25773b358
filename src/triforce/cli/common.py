"""What every subcommand shares: the one-line error, the parser class, and the checks of ``--threads``, ``--seed``."""

from __future__ import annotations

import argparse
import os

from ..errors import spelled
from ..speculation.hierarchy import MAX_SEED


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``triforce: error: ...``, exit status 2) instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"triforce: error: {message} (see `{self.prog} --help`)\n")


#: library parameter names that :func:`option_error` maps back to their options
_PARAMETERS = ("max_prompt_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "gamma1", "gamma2", "budget",
               "chunk_size", "rebuild_every", "draft_sink", "draft_window", "mode", "dtype", "system", "ngram_n",
               "ngram_min", "tiers", "chunk_score", "rebuild_below", "stop_below", "on_chip_layers", "tp",
               "logprobs")
#: library parameters whose option is not ``--`` + the name with ``-`` for ``_``
_FLAGS = {"drafter": "--draft", "prompt": "--prompt/--prompt-file"}


def flag(name: str) -> str:
    """The option of a library parameter: ``chunk_size`` -> ``--chunk-size`` (``drafter`` -> ``--draft``)."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def error_message(e: BaseException) -> str:
    """A library error's message with its parameters spelled as options (:mod:`triforce.errors`)."""
    return spelled(e, flag)


def option_error(e: ValueError) -> CLIError:
    """Map a library ValueError to the options' names: a :class:`~triforce.errors.ParameterError` names every
    parameter as its option ('--budget must be >= --chunk-size + ...'), another starting with a parameter name
    ('top_p must be ...') that one ('--top-p must be ...')."""
    msg = error_message(e)
    if msg != str(e):
        return CLIError(msg)
    for name in _PARAMETERS:
        if msg.startswith(name):
            return CLIError(flag(name) + msg[len(name):])
    return CLIError(msg)


def check_threads(threads: int | None) -> None:
    """``--threads`` of ``generate``, ``serve``, ``bench`` and ``analyze``: None (the subcommand's default) or an
    integer in [1, 4x the CPUs].

    Raises:
        CLIError: outside that range (the limit is in the message).
    """
    from ..kernels.threads import max_threads

    if threads is not None and not 1 <= threads <= max_threads():
        raise CLIError(f"--threads must be between 1 and {max_threads()} (4x this machine's {os.cpu_count()} CPUs), "
                       f"got {threads}")


def check_seed(seed: int | None) -> None:
    """``--seed`` of ``generate`` and ``serve``: None (random) or an integer in [0,
    :data:`~triforce.speculation.hierarchy.MAX_SEED`].

    Raises:
        CLIError: outside that range.
    """
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise CLIError(f"--seed must be an integer in [0, 2**63 - 1], got {seed}")
