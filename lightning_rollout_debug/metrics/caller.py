"""Warnings attributed to the user's code: the first frame outside the package and its hosts.

A warning raised deep in a training step would otherwise point into this package, or into
Lightning's loop that called it. :func:`warn` points it at the first frame outside this
package, Lightning (``lightning``, ``pytorch_lightning``, ``lightning_fabric``,
``lightning_utilities``) and torch: the line of the user's script or test that started
it (``warnings.warn``'s ``skip_file_prefixes`` from Python 3.12, the frames walked before).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn("a word", UserWarning)
    >>> caught[0].filename == __file__ or caught[0].filename.startswith("<doctest")
    True
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

HOSTS = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities")
"""The packages whose frames a warning passes over, besides this one's."""


def _folders() -> tuple[str, ...]:
    """This package's folder and those of :data:`HOSTS` that are installed, as prefixes."""
    folders = [os.path.dirname(os.path.dirname(__file__))]
    for name in HOSTS:
        spec = importlib.util.find_spec(name)  # found, not imported
        if spec is not None and spec.submodule_search_locations:
            folders += list(spec.submodule_search_locations)
    folders += [str(Path(folder).resolve()) for folder in folders]  # as frames may name them
    return tuple(os.path.join(folder, "") for folder in dict.fromkeys(folders))


SKIPPED = _folders()
"""The folders whose frames a warning is not attributed to."""


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` at the first frame outside :data:`SKIPPED`.

    Where every frame is in it, at the outermost one.
    """
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=SKIPPED)
        return
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(SKIPPED):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
