"""The training-loop side: the monitor of any loop, the Lightning callback, their settings.

It holds a window per run, decides when it is logged and over which ranks, writes it
through :mod:`lightning_rollout_debug.views`, acts on :mod:`lightning_rollout_debug.checks`
and keeps the checkpoint state. The only part of the package that imports Lightning.
"""
