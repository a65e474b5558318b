"""steplib: a functional, composable training toolkit for PyTorch."""

from steplib.errors import ConfigError, LossFnError, StepLibError, TooManySkipsError
from steplib.events import EVENT_NAMES, Event, Events, NewState, Stop
from steplib.loop import iterate, run
from steplib.schedules import accumulation_steps, warmup_constant, warmup_cosine, warmup_linear
from steplib.state import StepOutput, TrainState
from steplib.step import (
    GradSync,
    Step,
    accumulate,
    amp_wrap,
    clip,
    compile_step,
    ddp_wrap,
    fsdp_wrap,
    make_train_step,
    skip_nonfinite,
)

__version__ = "0.1.0"

__all__ = [
    "EVENT_NAMES",
    "ConfigError",
    "Event",
    "Events",
    "GradSync",
    "LossFnError",
    "NewState",
    "Step",
    "StepLibError",
    "StepOutput",
    "Stop",
    "TooManySkipsError",
    "TrainState",
    "__version__",
    "accumulate",
    "accumulation_steps",
    "amp_wrap",
    "clip",
    "compile_step",
    "ddp_wrap",
    "fsdp_wrap",
    "iterate",
    "make_train_step",
    "run",
    "skip_nonfinite",
    "warmup_constant",
    "warmup_cosine",
    "warmup_linear",
]
