"""The exceptions steplib raises. Every message says what was received, why it is wrong and the fix.

Imports nothing from steplib, so every module may raise these.
"""

from __future__ import annotations


class StepLibError(Exception):
    """Base class of every error steplib raises on purpose."""


class ConfigError(StepLibError, ValueError):
    """A bad argument or an impossible composition, found when the step or state is built."""


class LossFnError(StepLibError, TypeError):
    """The user's ``loss_fn`` returned something steplib cannot train on."""


class TooManySkipsError(StepLibError, RuntimeError):
    """``skip_nonfinite`` saw more consecutive non-finite updates than it was allowed."""


def describe(value: object) -> str:
    """A short description of a received value for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (type {type(value).__name__})"
