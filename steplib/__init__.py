"""steplib: a functional, composable training toolkit for PyTorch."""

from steplib import checkpoint, data, seeding
from steplib.checkpoint import (
    AsyncSaver,
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    checkpoint_every,
    preemption,
    resume_from,
)
from steplib.data import resumable_loader
from steplib.distributed.activation_checkpointing import checkpoint_activations
from steplib.errors import ConfigError, LossFnError, StepLibError, TooManySkipsError
from steplib.events import EVENT_NAMES, Event, Events, NewState, Stop
from steplib.handlers import export
from steplib.handlers.ema import EMA
from steplib.handlers.eval_step import EvalStep, evaluate, make_eval_step
from steplib.handlers.evaluation import Evaluator
from steplib.handlers.export import ExportBest, ExportError, export_best, export_model
from steplib.handlers.logging import (
    ConsoleLogger,
    CSVLogger,
    JsonlLogger,
    Log,
    Logger,
    LogWriteError,
    TensorBoardLogger,
    event_record,
)
from steplib.handlers.metrics import TrainMetrics
from steplib.handlers.monitors import GradNormMonitor, LRMonitor, NonFiniteAlarm, NonFiniteError
from steplib.handlers.profiling import Profiler
from steplib.handlers.progress import ProgressBar
from steplib.handlers.stopping import BestValue, EarlyStopping, StopFile, TimeLimit
from steplib.handlers.throughput import Throughput, count_flops, flops_per_batch
from steplib.loop import iterate, run
from steplib.schedules import accumulation_steps, warmup_constant, warmup_cosine, warmup_linear
from steplib.seeding import loader_generator, seed_everything, seeded_worker_init_fn
from steplib.state import StepOutput, TrainState
from steplib.step import (
    AnomalyError,
    CompileStats,
    GradSync,
    Step,
    accumulate,
    amp_wrap,
    clip,
    compile_step,
    ddp_wrap,
    detect_anomaly,
    fsdp_wrap,
    make_pipeline_step,
    make_train_step,
    skip_nonfinite,
    tap,
)

__version__ = "0.1.0"

__all__ = [
    "EMA",
    "EVENT_NAMES",
    "AnomalyError",
    "AsyncSaver",
    "BestValue",
    "CSVLogger",
    "CheckpointError",
    "CheckpointWarning",
    "CompileStats",
    "ConfigError",
    "ConsoleLogger",
    "CorruptCheckpointError",
    "EarlyStopping",
    "EvalStep",
    "Evaluator",
    "Event",
    "Events",
    "ExportBest",
    "ExportError",
    "GradNormMonitor",
    "GradSync",
    "JsonlLogger",
    "LRMonitor",
    "Log",
    "LogWriteError",
    "Logger",
    "LossFnError",
    "NewState",
    "NonFiniteAlarm",
    "NonFiniteError",
    "Profiler",
    "ProgressBar",
    "Step",
    "StepLibError",
    "StepOutput",
    "Stop",
    "StopFile",
    "TensorBoardLogger",
    "Throughput",
    "TimeLimit",
    "TooManySkipsError",
    "TrainMetrics",
    "TrainState",
    "__version__",
    "accumulate",
    "accumulation_steps",
    "amp_wrap",
    "checkpoint",
    "checkpoint_activations",
    "checkpoint_every",
    "clip",
    "compile_step",
    "count_flops",
    "data",
    "ddp_wrap",
    "detect_anomaly",
    "evaluate",
    "event_record",
    "export",
    "export_best",
    "export_model",
    "flops_per_batch",
    "fsdp_wrap",
    "iterate",
    "loader_generator",
    "make_eval_step",
    "make_pipeline_step",
    "make_train_step",
    "preemption",
    "resumable_loader",
    "resume_from",
    "run",
    "seed_everything",
    "seeded_worker_init_fn",
    "seeding",
    "skip_nonfinite",
    "tap",
    "warmup_constant",
    "warmup_cosine",
    "warmup_linear",
]
