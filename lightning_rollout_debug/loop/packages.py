"""The Lightning packages: ``pytorch_lightning`` always, the unified ``lightning`` where installed.

Lightning ships the same classes twice: as ``pytorch_lightning`` (with
``lightning_fabric``) and as ``lightning.pytorch`` (with ``lightning.fabric``). Each
package checks callbacks and loggers against its own classes, so a callback derived from
one is refused by the other's ``LightningCLI``, and a logger of one is not an instance of
the other's ``TensorBoardLogger``. Here the callback's base derives from the ``Callback``
of every installed package, and TensorBoard loggers are recognised by the Fabric base
class that every package's ``TensorBoardLogger`` derives from.

Example:
    >>> import pytorch_lightning as pl
    >>> issubclass(Callback, pl.Callback)
    True
    >>> from pytorch_lightning.loggers import TensorBoardLogger
    >>> issubclass(TensorBoardLogger, TENSORBOARD_LOGGERS)
    True
"""

from __future__ import annotations

import pytorch_lightning as pl
from lightning_fabric.loggers import TensorBoardLogger as _FabricTensorBoardLogger
from lightning_utilities.core.imports import RequirementCache

LIGHTNING_AVAILABLE = RequirementCache("lightning>=2.0", "lightning.pytorch")
"""Whether the unified ``lightning`` package (``import lightning as L``) is installed."""

if LIGHTNING_AVAILABLE:
    import lightning.pytorch as _unified
    from lightning.fabric.loggers import TensorBoardLogger as _UnifiedTensorBoardLogger

    class _BothCallback(pl.Callback, _unified.Callback):
        """A callback of both packages: ``pytorch_lightning`` and ``lightning.pytorch``.

        The two base classes are the same code (every hook a no-op), so the hooks and the
        state key resolve alike through either; each package's Trainer and
        ``LightningCLI`` accept the subclass as one of its own callbacks. Its name is
        private, so ``LightningCLI`` lists only the package's callback, not this base.
        """

    Callback: type[pl.Callback] = _BothCallback

    _UNIFIED_LOGGERS: tuple[type, ...] = (_UnifiedTensorBoardLogger,)
else:
    Callback = pl.Callback  # type: ignore[misc]
    _UNIFIED_LOGGERS = ()

TENSORBOARD_LOGGERS: tuple[type, ...] = (_FabricTensorBoardLogger, *_UNIFIED_LOGGERS)
"""The TensorBoard loggers: Fabric's of each package, the base of its Trainer's one too."""
