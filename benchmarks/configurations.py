"""The callback configurations the benchmarks compare, defined once.

* the defaults: statistics, histograms, worst tokens, and the profile (the quantiles
  group and the pictures);
* :data:`NO_PROFILE`: the defaults without the profile, the defaults before it existed;
* :data:`SCALARS_ONLY`: the statistics alone, written as scalars.

The benchmarks' batches carry no token ids, so the ``token_ids`` group is left out, as
the defaults leave it out without ``token_ids_keys``.
"""

from __future__ import annotations

from lightning_rollout_debug import GROUPS

WITH_PROFILE = [group for group in GROUPS if group != "token_ids"]
"""The groups of the defaults."""

NO_PROFILE: dict[str, object] = {
    "groups": [group for group in WITH_PROFILE if group != "quantiles"],
    "profile_images": False,
}
SCALARS_ONLY: dict[str, object] = {
    **NO_PROFILE,
    "histograms": False,
    "worst_tokens_k": 0,
    "dashboard_layout": False,
}
