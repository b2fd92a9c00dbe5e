"""What a diagnosis says: its kind, its message, and the order kinds are named in.

A :class:`Diagnosis` names one pipeline mistake and its fix. Kinds come in two ranks: the
causes (:data:`CAUSES`: a mistake of the pipeline itself, misaligned or shifted log-probs,
padding in the mask, masked logits, dropout, stale weights) and the symptoms
(:data:`SYMPTOMS`: what the KL estimates show, truncated or one-sided sampling). A cause
explains the symptoms of its window: where one is named, the symptoms are not named as
causes of their own (:func:`in_order`).

Example:
    >>> found = [Diagnosis("truncated", "k1 far above k3"), Diagnosis("padding", "zeros")]
    >>> [d.kind for d in in_order(found)]
    ['padding']
    >>> [d.kind for d in in_order(found[:1])]
    ['truncated']
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

CAUSES = ("misaligned", "prompt", "padding", "masked_logits", "dropout", "stale")
"""The mistakes of the pipeline itself, in the order they are named."""
SYMPTOMS = ("truncated", "one_sided")
"""What the KL estimates show of the sampling; a cause of the same window explains them."""
KINDS = (
    "misaligned",
    "padding",
    "truncated",
    "one_sided",
    "masked_logits",
    "prompt",
    "dropout",
    "stale",
)
"""The kinds of diagnosis, each warned about once per run."""


class RolloutDiagnosisWarning(UserWarning):
    """A pipeline mistake the window shows (its message names the fix)."""


class RolloutDiagnosisError(RuntimeError):
    """A pipeline mistake, raised instead of warned about with ``strict=True``."""


@dataclass(frozen=True)
class Diagnosis:
    """One named mistake: its kind (one of :data:`KINDS`) and a message with the fix."""

    kind: str
    message: str


def in_order(found: Sequence[Diagnosis], known: Collection[str] = ()) -> list[Diagnosis]:
    """The causes of ``found`` first, in :data:`CAUSES`' order; its symptoms only without one.

    ``known``: causes found outside the window (dropout, at the start of training), which
    explain its symptoms as well.
    """
    causes = sorted((d for d in found if d.kind in CAUSES), key=lambda d: CAUSES.index(d.kind))
    symptoms = [d for d in found if d.kind not in CAUSES]
    if not causes:
        return [] if set(known) & set(CAUSES) else symptoms
    if symptoms:  # said as what the first cause explains, not as causes of their own
        shown = " and ".join(d.kind.replace("_", "-") for d in symptoms)
        first = causes[0]
        causes[0] = Diagnosis(
            first.kind,
            f"{first.message} The KL estimates of this window also read like {shown} "
            "sampling: a consequence of it, not a cause of its own.",
        )
    return causes
