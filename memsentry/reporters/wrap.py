"""Paragraph filling in time linear in the text's length, for every text reporter.

:func:`textwrap.fill` cuts a word longer than a line one line at a time, copying the rest of
the word at each cut: a 10 MB message without a space takes minutes. :func:`fill` gives the
same lines, cutting such a word into all its lines in one pass.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator


def _cut(word: str, start: int, space: int, hyphens: bool) -> int:
    """Where the line that begins at ``start`` of ``word`` ends, with ``space`` characters
    free: after the last hyphen that fits (and follows something other than hyphens) when
    ``hyphens``, else after ``space`` characters; as :mod:`textwrap` cuts."""
    end = start + space
    if hyphens and len(word) > end:
        hyphen = word.rfind("-", start, end)
        if hyphen > start and word[start:hyphen].strip("-"):
            return hyphen + 1
    return end


def _pieces(word: str, first: int, space: int, hyphens: bool) -> Iterator[str]:
    """``word`` cut into its lines: the first with ``first`` characters free, the others
    with ``space``, the last (at most ``space`` long) left for the words that follow."""
    start, free = 0, first
    while len(word) - start > free:
        end = _cut(word, start, free, hyphens)
        yield word[start:end]
        start, free = end, space
    yield word[start:]


class _Wrapper(textwrap.TextWrapper):
    """A :class:`textwrap.TextWrapper` that cuts a long word in one pass."""

    def _handle_long_word(self, reversed_chunks: list[str], cur_line: list[str],
                          cur_len: int, width: int) -> None:
        first = 1 if width < 1 else width - cur_len
        if not self.break_long_words or first < 1 or not reversed_chunks[-1].strip():
            # nothing to cut (a full line; spaces, which a new line drops): as textwrap does
            super()._handle_long_word(reversed_chunks, cur_line, cur_len, width)
            return
        space = max(self.width - len(self.subsequent_indent), 1)  # the lines that follow
        head, *rest = _pieces(reversed_chunks.pop(), first, space, self.break_on_hyphens)
        cur_line.append(head)
        # each piece fills its own line, as textwrap's cuts do; the last is any other word
        reversed_chunks.extend(reversed(rest))


def fill(text: str, width: int = 70, *, subsequent_indent: str = "",
         break_on_hyphens: bool = True) -> str:
    """:func:`textwrap.fill`'s paragraph (the same lines for the same options), in time linear
    in ``len(text)``."""
    wrapper = _Wrapper(width=width, subsequent_indent=subsequent_indent,
                       break_on_hyphens=break_on_hyphens)
    return wrapper.fill(text)


__all__ = ["fill"]
