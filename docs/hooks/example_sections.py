"""Griffe extension: steplib's ``Example:`` sections are read as Google ``Examples:`` sections.

steplib's docstrings say ``Example:`` (DESIGN.md §5.5: Args, Returns, Raises, and an example).
Griffe's Google parser knows only the plural; the singular becomes an admonition whose
doctest is rendered as prose. This extension renames the header (the docstrings stay as they
are), so that each example is shown as a code block with its output.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

HEADER = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` to ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the header of ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = HEADER.sub(r"\1Examples:", obj.docstring.value)
