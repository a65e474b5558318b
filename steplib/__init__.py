"""steplib: a functional, composable training toolkit for PyTorch.

The everyday names are here; everything else is imported from its subpackage:
``steplib.step`` (the composition API, ``detect_anomaly``, the pipeline step),
``steplib.handlers`` (every handler), ``steplib.checkpoint``, ``steplib.distributed``,
``steplib.schedules``, ``steplib.seeding``, ``steplib.data``, ``steplib.errors`` and
``steplib.testing``.
"""

from steplib.checkpoint import CheckpointError, checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.errors import ConfigError, LossFnError, StepLibError
from steplib.events import Event, Events, NewState, Stop
from steplib.handlers import (
    EMA,
    ConsoleLogger,
    CSVLogger,
    EarlyStopping,
    Evaluator,
    JsonlLogger,
    ProgressBar,
    TensorBoardLogger,
    Throughput,
    TrainMetrics,
    evaluate,
    make_eval_step,
)
from steplib.loop import iterate, run
from steplib.output import StepOutput
from steplib.schedules import warmup_cosine, warmup_linear
from steplib.seeding import seed_everything
from steplib.state import TrainState
from steplib.step import (
    Step,
    accumulate,
    amp_wrap,
    clip,
    compile_step,
    ddp_wrap,
    fsdp_wrap,
    make_train_step,
    skip_nonfinite,
    tap,
)

__version__ = "0.1.0"

__all__ = [
    "EMA",
    "CSVLogger",
    "CheckpointError",
    "ConfigError",
    "ConsoleLogger",
    "EarlyStopping",
    "Evaluator",
    "Event",
    "Events",
    "JsonlLogger",
    "LossFnError",
    "NewState",
    "ProgressBar",
    "Step",
    "StepLibError",
    "StepOutput",
    "Stop",
    "TensorBoardLogger",
    "Throughput",
    "TrainMetrics",
    "TrainState",
    "accumulate",
    "amp_wrap",
    "checkpoint_every",
    "clip",
    "compile_step",
    "ddp_wrap",
    "evaluate",
    "fsdp_wrap",
    "iterate",
    "make_eval_step",
    "make_train_step",
    "resumable_loader",
    "resume_from",
    "run",
    "seed_everything",
    "skip_nonfinite",
    "tap",
    "warmup_cosine",
    "warmup_linear",
]
