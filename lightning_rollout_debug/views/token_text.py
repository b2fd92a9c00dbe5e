r"""The text of the worst tokens: a tokenizer's pieces, escaped for a Markdown table cell.

:class:`TokenText` reads token ids with whichever methods a tokenizer has: ``decode(ids)``
(a ``transformers`` tokenizer, a ``tokenizers.Tokenizer``), else
``convert_ids_to_tokens(ids)`` or ``id_to_token(id)``. With ``decode``, each token's text
is what it adds to the decoded text of the tokens before it, so that a tokenizer's
spaces and merged bytes read as they do in the decoded response. An id without text of
its own (bytes of a character split over several tokens, an id the tokenizer does not
know) is shown as ``⟨id⟩``. :func:`markdown_cell` makes whitespace visible (``␣`` a space,
``↵`` a newline, ``→`` a tab) and escapes what Markdown would read as a table's border,
emphasis or markup.

Example:
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> words = Tokenizer(models.WordLevel({"[UNK]": 0, "a|b": 1, "c": 2}, unk_token="[UNK]"))
    >>> text = TokenText(words)
    >>> text.pieces([1, 2, 9])
    ['a|b', ' c', None]
    >>> [markdown_cell(piece) for piece in text.pieces([1, 2])]
    ['a\\|b', '␣c']
    >>> text.cells([1, 2], 9)
    ('a\\|b␣c', '⟨9⟩')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["WHITESPACE", "TokenText", "markdown_cell", "tokenizer_problems"]

WHITESPACE = {" ": "␣", "\n": "↵", "\t": "→", "\r": "␍"}
"""How each whitespace character is shown in a cell."""

_ESCAPED = str.maketrans({**{c: "\\" + c for c in "\\`*_{}[]()#+-.!|>"}, "<": "&lt;", "&": "&amp;"})
"""Markdown's punctuation, backslash-escaped; ``<`` and ``&`` as HTML entities."""

_DECODE_OPTIONS: tuple[dict[str, bool], ...] = (
    {"skip_special_tokens": False, "clean_up_tokenization_spaces": False},
    {"skip_special_tokens": False},
    {},
)
"""What ``decode`` is asked for, the most first: special tokens kept, spaces as decoded."""

_ACCEPTED = (
    "a tokenizer with `decode(ids)` (a transformers tokenizer or a tokenizers.Tokenizer), "
    "`convert_ids_to_tokens(ids)` or `id_to_token(id)`"
)


def tokenizer_problems(tokenizer: Any) -> list[str]:
    """What is wrong with a ``tokenizer`` argument (empty if nothing).

    Example:
        >>> tokenizer_problems("gpt2")[0].startswith("`tokenizer` must be None or a tokenizer")
        True
    """
    if tokenizer is None:
        return []
    if isinstance(tokenizer, (str, bytes)):
        hint = " Load it first, e.g. `AutoTokenizer.from_pretrained(name)`."
    elif isinstance(tokenizer, type):
        hint = " Pass an instance, not the class."
    elif any(callable(getattr(tokenizer, name, None)) for name in _METHODS):
        return []
    else:
        hint = ""
    return [f"`tokenizer` must be None or {_ACCEPTED}; got a {type(tokenizer).__name__}.{hint}"]


_METHODS = ("decode", "convert_ids_to_tokens", "id_to_token")


class TokenText:
    """The text of token ids, from ``tokenizer`` (see the module).

    :attr:`failure` names the first error the tokenizer raised (its ids are then shown
    as ids), or is ``None``.
    """

    def __init__(self, tokenizer: Any) -> None:
        problems = tokenizer_problems(tokenizer)
        if tokenizer is None or problems:
            raise ValueError(problems[0] if problems else f"`tokenizer` must be {_ACCEPTED}.")
        self.tokenizer = tokenizer
        self.failure: str | None = None
        self._options = 0  # the first of _DECODE_OPTIONS that decode takes

    def pieces(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's text, read after the ids before it; ``None`` where it has none."""
        try:
            if callable(getattr(self.tokenizer, "decode", None)):
                return self._decoded_pieces(ids)
            if callable(getattr(self.tokenizer, "convert_ids_to_tokens", None)):
                found = list(self.tokenizer.convert_ids_to_tokens(list(ids)))
            else:
                found = [self.tokenizer.id_to_token(i) for i in ids]
        except Exception as error:  # a tokenizer's own error: the ids are shown instead
            self.failure = self.failure or f"{type(self.tokenizer).__name__}: {error!r}"
            return [None] * len(ids)
        return [piece if isinstance(piece, str) and piece else None for piece in found]

    def cells(self, context: Sequence[int], token_id: int) -> tuple[str, str]:
        """The cells of a token: the text of its ``context``, and its own, escaped."""
        ids = [*context, token_id]
        shown = [
            f"⟨{i}⟩" if piece is None else markdown_cell(piece)
            for i, piece in zip(ids, self.pieces(ids), strict=True)
        ]
        return "".join(shown[:-1]), shown[-1]

    def _decoded_pieces(self, ids: Sequence[int]) -> list[str | None]:
        """What each id adds to the decoded text of the ids before it."""
        pieces: list[str | None] = []
        before = ""
        for end in range(1, len(ids) + 1):
            text = self._decode(list(ids[:end]))
            piece = text[len(before) :] if text.startswith(before) else ""
            pieces.append(piece if piece and "\ufffd" not in piece else None)
            before = text
        return pieces

    def _decode(self, ids: list[int]) -> str:
        """``decode(ids)`` with the most of :data:`_DECODE_OPTIONS` it takes."""
        while True:
            try:
                return str(self.tokenizer.decode(ids, **_DECODE_OPTIONS[self._options]))
            except TypeError:
                if self._options == len(_DECODE_OPTIONS) - 1:
                    raise
                self._options += 1


def markdown_cell(text: str) -> str:
    r"""``text`` for a Markdown table cell: whitespace visible, markup escaped.

    A space is ``␣``, a newline ``↵``, a tab ``→``, a carriage return ``␍``; other
    characters that do not print are shown as Python escapes (``\x0b``).

    Example:
        >>> print(markdown_cell(" a|b\n\t*<s>"))
        ␣a\|b↵→\*&lt;s\>
    """
    shown = "".join(
        WHITESPACE.get(c, c if c.isprintable() else c.encode("unicode_escape").decode())
        for c in text
    )
    return shown.translate(_ESCAPED)
