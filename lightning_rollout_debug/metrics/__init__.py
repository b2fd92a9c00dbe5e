"""The math that needs no training loop: from a batch's tensors to packed windows and metrics.

The declarations (:mod:`.catalog` with the readings of :mod:`.formulas`, :mod:`.layout`,
:mod:`.bins`, :mod:`.histograms`, :mod:`.worst_tokens`, :mod:`.profile`, :mod:`.rows`), the
road of a batch (:mod:`.batch` and :mod:`.inputs`, :mod:`.backends`, the torch pass of
:mod:`.torch_pass` and :mod:`.tokens` or the kernel of :mod:`.native`, then :mod:`.finish`
and :mod:`.finish_extras`), and the windows (:mod:`.packed_window`, :mod:`.stats`,
:mod:`.extras`). Nothing here imports Lightning, TensorBoard or Pillow, nor the package's
loop, views or checks.
"""
