"""The tqdm class that draws steplib's bars and lines: ``tqdm.auto`` only where ipywidgets is.

``tqdm.auto`` picks the notebook widget in Jupyter, but in a kernel without ipywidgets it warns
("IProgress not found. Please update jupyter and ipywidgets") and falls back to the text bar
of ``tqdm.std``. Choosing ``tqdm.std`` ourselves when ipywidgets cannot be found gives the same
text bar without the warning, which a user would otherwise see on ``import steplib``. Decided
at each call, not at import: importing steplib imports no tqdm front end, and a notebook that
installs ipywidgets gets the widget in its next run.

Imports nothing from steplib.
"""

from __future__ import annotations

import importlib.util
from typing import Any


def tqdm_class() -> Any:
    """The tqdm class to draw with now: the progress bar and the console sink share it, so
    that a logged line is written above the bar (``tqdm_class().write(line)``), not through it.

    Returns:
        ``tqdm.auto.tqdm`` when ipywidgets can be imported, else ``tqdm.std.tqdm``.

    Example:
        >>> import tqdm
        >>> issubclass(tqdm_class(), tqdm.std.tqdm)
        True
    """
    if _ipywidgets_found():
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def _ipywidgets_found() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        return False
