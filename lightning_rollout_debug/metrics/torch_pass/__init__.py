"""The torch arithmetic of an update, for accelerators and CPUs without the native kernel.

- ``planes.py``: what a pass computes (``PassPlan``), its named ``[B, T]`` planes
  (``Planes``) and the workspaces a CPU pass keeps them in;
- ``constants.py``: the bin edges, fills and offsets of a pass, made once a device;
- ``values.py``: ``token_values``, each token's values as planes, a run of them an
  operation;
- ``sums.py``: ``token_sums``, one read of a batch into its row sums, largest and smallest
  values, centred moments, lag products and the extras' sums (``TokenSums``);
- ``bins.py``: the extras of a pass: counted bins, sums by bucket, worst-token candidates;
- ``health.py``: the health group's values: padding zeros, the masked actor, lag products;
- ``segments.py``: the sums by segment row (``SegmentRows``): each row's tokens of one
  segment (turn, data source, task) reduced as a row of their own.
"""
