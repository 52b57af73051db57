"""A page's results as a table: HTML where the notebook shows HTML, aligned text elsewhere.

A table printed as fixed-width text scrolls sideways on a phone, or in a narrow column,
and wraps into nonsense if it is made to fit. :class:`Table` is displayed by Jupyter and
myst-nb as an HTML table, whose cells wrap within the width there is, and keeps an aligned
text form for what reads text: a terminal, ``print``, the tests.

Written by hand: IPython's ``display`` takes an object's ``_repr_html_``, and pandas (whose
``DataFrame`` has one) is not among the guide's dependencies for one table format.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence

__all__ = ["Table"]

_NUMBER = re.compile(r"[-+]?(\d[\d,]*\.?\d*|\.\d+)([eE][-+]?\d+)?%?|nan|inf|-inf")


class Table:
    """Rows under a header, shown as an HTML table in a notebook and as aligned text by ``str``.

    Cells are shown as given (``str`` of each): format numbers before, as the page wants
    them read. A column whose cells are all numbers is aligned right.

    >>> from fsdp_guide.table import Table
    >>> table = Table(["strategy", "all-gathers", "sent / P"], [["FULL_SHARD", 6, "1.50"], ["NO_SHARD", 0, "2.00"]])
    >>> print(table)
    strategy    all-gathers  sent / P
    FULL_SHARD            6      1.50
    NO_SHARD              0      2.00
    >>> '<th class="numeric">sent / P</th>' in table._repr_html_()
    True
    >>> Table(["a", "b"], [[1]])
    Traceback (most recent call last):
    ...
    ValueError: row 0 has 1 cells, the header 2: give every row one cell per column
    """

    def __init__(self, header: Sequence[object], rows: Iterable[Sequence[object]]):
        self.header = [str(cell) for cell in header]
        self.rows = [[str(cell) for cell in row] for row in rows]
        for index, row in enumerate(self.rows):
            if len(row) != len(self.header):
                raise ValueError(
                    f"row {index} has {len(row)} cells, the header {len(self.header)}: "
                    "give every row one cell per column"
                )

    def _numeric(self, column: int) -> bool:
        cells = [row[column] for row in self.rows]
        return bool(cells) and all(_NUMBER.fullmatch(cell.strip()) for cell in cells)

    def __str__(self) -> str:
        columns = range(len(self.header))
        widths = [max(len(row[c]) for row in (self.header, *self.rows)) for c in columns]
        right = [self._numeric(c) for c in columns]

        def line(row: Sequence[str]) -> str:
            cells = (cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right))
            return "  ".join(cells).rstrip()

        return "\n".join(line(row) for row in (self.header, *self.rows))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        right = [self._numeric(c) for c in range(len(self.header))]

        def cells(row: Sequence[str], tag: str) -> str:
            return "".join(
                f'<{tag} class="numeric">{html.escape(cell)}</{tag}>' if r else f"<{tag}>{html.escape(cell)}</{tag}>"
                for cell, r in zip(row, right)
            )

        head = f"<thead><tr>{cells(self.header, 'th')}</tr></thead>"
        body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in self.rows)
        return f'<table class="fsdp-guide-table">{head}<tbody>{body}</tbody></table>'
