"""Step builders and wrappers: each wrapper is ``Step -> Step``."""

from steplib.step.accumulate import accumulate
from steplib.step.amp import amp_wrap
from steplib.step.clip import clip
from steplib.step.core import Step, make_train_step
from steplib.step.skip import skip_nonfinite

__all__ = ["Step", "accumulate", "amp_wrap", "clip", "make_train_step", "skip_nonfinite"]
