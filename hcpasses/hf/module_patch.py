"""Point a function that loaded transformers modules look up as a global at a replacement, for a ``with`` block.

``unittest.mock.patch`` patches one named target; the contexts of :mod:`hcpasses.hf` patch the same global in
every module that imported it (each ``from ... import f`` is a binding of its own), so this small helper does it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


def loaded_modules_with(attribute: str, prefix: str) -> list[str]:
    """The loaded modules named ``prefix`` or ``prefix.*`` that have ``attribute`` (a callable), sorted."""
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if (name == prefix or name.startswith(prefix + ".")) and callable(getattr(module, attribute, None))
    )


@contextlib.contextmanager
def module_attributes_replaced(
    names: list[str], attribute: str, replacement: Callable[[str, Any], Any]
) -> Iterator[list[str]]:
    """Sets ``attribute`` of each module in ``names`` to ``replacement(module name, current value)`` and restores
    the values on exit, also when the block raises. Yields ``names``."""
    saved = {name: getattr(sys.modules[name], attribute) for name in names}
    try:
        for name, current in saved.items():
            setattr(sys.modules[name], attribute, replacement(name, current))
        yield names
    finally:
        for name, current in saved.items():
            setattr(sys.modules[name], attribute, current)
