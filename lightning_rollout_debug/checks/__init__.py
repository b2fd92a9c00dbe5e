"""What a logged window is judged by: fixed ranges, drift from a baseline, pipeline mistakes.

The checks read a window's metrics (:mod:`lightning_rollout_debug.metrics`) and say what is
wrong; acting on it (a warning, a stop, an error) is the loop's.
"""
