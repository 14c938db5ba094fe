"""A griffe extension that shows the docstrings' reST roles (``:class:`X` ``, ``:meth:`~a.b.c` ``) as inline code.

flasync's docstrings name other objects with Sphinx roles; mkdocstrings reads them as Markdown, where a role would
print verbatim. This rewrites each role to the name it shows (``~`` keeps the last part), as inline code.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(?P<target>~?[^`]+)`")


def _shown(match: re.Match[str]) -> str:
    target = match.group("target")
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


def plain_roles(text: str) -> str:
    """Return text with every reST role replaced by inline code of the name it shows."""
    return _ROLE.sub(_shown, text)


# The config page's generator (and its test) use plain_roles without the docs extra; griffe comes with it.
if importlib.util.find_spec("griffe") is not None:
    import griffe

    class PlainRoles(griffe.Extension):
        """Rewrite the roles of every docstring griffe loads."""

        def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
            """Rewrite one object's docstring in place."""
            if obj.docstring is not None:
                obj.docstring.value = plain_roles(obj.docstring.value)
