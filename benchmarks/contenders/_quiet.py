"""Silencing the peers' warnings and log lines, only while the harness is inside their code.

The peers warn about things that are deliberate here (no workers on an in-memory pool, a
single device, barebones mode, torch deprecations they have not caught up with) and print
banners through ``logging``. Left alone, a warning fails the test suite (``filterwarnings =
error``) and the banners break the table; a global filter would also hide steplib's warnings,
so the filters are installed only around calls into the peer.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def quiet(loggers: Sequence[str]) -> Iterator[None]:
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    with warnings.catch_warnings():
        # Every category: the peers emit UserWarning, DeprecationWarning, FutureWarning and
        # their own PossibleUserWarning; none of them changes what is measured.
        warnings.simplefilter("ignore")
        for logger, _ in saved:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in saved:
                logger.setLevel(level)
