"""The math that needs no training loop: from a batch's tensors to packed windows and metrics.

Declarations (:mod:`.catalog`, :mod:`.layout`, :mod:`.bins`, :mod:`.profile`), the road of
a batch (:mod:`.batch`, :mod:`.backends`, :mod:`.token_pass`, :mod:`.native`, :mod:`.rows`,
:mod:`.finish`), the windows (:mod:`.stats`, :mod:`.extras`) and what they read back on the
host (:mod:`.histograms`, :mod:`.worst_tokens`, :class:`~.profile.Profile`). Nothing here
imports Lightning, TensorBoard or Pillow, nor the package's loop, views or checks.
"""
