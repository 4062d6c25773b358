"""Errors that name the caller's parameters as the caller spells them.

Validation is shared by the Python API and the command line, so a message must not spell a parameter one way for
both. A message names parameters in backquotes (``"`budget` must be >= ..."``): ``str(e)`` spells each by the Python
API's parameter name (``budget``), and :meth:`NamesParameters.spelled` as another caller spells it (the command
line: ``--budget``, :func:`triforce.cli.common.flag`).
"""

from __future__ import annotations

import re
from typing import Callable

_NAME = re.compile(r"`([a-z][a-z0-9_]*)`")


class NamesParameters:
    """Mixin of an exception whose message names parameters in backquotes (module docstring).

    Attributes:
        template: the message with the parameters in backquotes.
    """

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.spelled(lambda name: name))

    def spelled(self, spell: Callable[[str], str]) -> str:
        """The message with each parameter name replaced by ``spell(name)``."""
        return _NAME.sub(lambda m: spell(m.group(1)), self.template)


class ParameterError(NamesParameters, ValueError):
    """A bad argument (a ValueError): its message names the parameter and the allowed values."""


def spelled(e: BaseException, spell: Callable[[str], str]) -> str:
    """``e``'s message with its parameters spelled by ``spell`` (:class:`NamesParameters`), else ``str(e)``."""
    return e.spelled(spell) if isinstance(e, NamesParameters) else str(e)
