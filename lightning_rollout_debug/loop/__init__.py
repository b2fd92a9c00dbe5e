"""The training-loop side: the monitor of any loop, the Lightning callback, their settings.

:mod:`.monitor` holds a window per run (:mod:`.window`), reads each batch into it
(:mod:`.batch_updates`), logs it over the ranks (:mod:`.logged_step`, :mod:`.ranks`,
:mod:`.logs`) through :mod:`lightning_rollout_debug.views`, acts on
:mod:`lightning_rollout_debug.checks`, and keeps its checkpoint state (:mod:`.checkpoint`);
:mod:`.config` and :mod:`.arguments` check its settings, and :mod:`.callback` drives it
from a Trainer. The only part of the package that imports Lightning (:mod:`.packages`).
"""
