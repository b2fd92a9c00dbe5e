"""What a logged window is drawn and written as: TensorBoard's extras, the profile's pictures.

Each module reads a window's host summary (:mod:`lightning_rollout_debug.metrics`) and
writes or draws it; none knows of a training loop or of the checks.
"""
