"""Handlers: objects whose ``on_<event>`` methods an emitter registers (each a
:class:`~steplib.events.Handler`), and plain callables of one :class:`~steplib.events.Event`.

Every handler of steplib is here, one concept per module: evaluation (``eval_step``: the eval
step and ``evaluate``; ``evaluation``: the ``Evaluator`` handler), training metrics
(``metrics``), logs (``logging/``), the progress bar (``progress``, drawn with the tqdm class of
``terminal``), stopping rules (``stopping``), monitors of the gradient norm, the LR and
non-finite values (``monitors``), ``throughput``, ``profiling``, ``ema``, ``export``, the
per-epoch or plateau ``Scheduler`` (``scheduling``) and the notebook's curves (``live_plot``).

Handlers import ``events``, ``state``, ``errors``, ``distributed`` and ``checkpoint``; never
``loop`` or ``step``, so that a handler works with any loop that emits the events.
"""

from steplib.errors import ExportError, LogWriteError, NonFiniteError
from steplib.handlers.ema import EMA
from steplib.handlers.eval_step import EvalStep, as_metrics, eval_mode, evaluate, make_eval_step
from steplib.handlers.evaluation import Evaluator
from steplib.handlers.export import ExportBest, export_best, export_model
from steplib.handlers.full_weights import full_state_dict
from steplib.handlers.live_plot import LivePlot
from steplib.handlers.logging import (
    ConsoleLogger,
    CSVLogger,
    JsonlLogger,
    Log,
    Logger,
    MLflowLogger,
    Sink,
    TensorBoardLogger,
    WandbLogger,
    event_counters,
    event_record,
)
from steplib.handlers.metrics import TrainMetrics
from steplib.handlers.monitors import GradNormMonitor, LRMonitor, NonFiniteAlarm
from steplib.handlers.profiling import Profiler
from steplib.handlers.progress import ProgressBar
from steplib.handlers.scheduling import Scheduler
from steplib.handlers.stopping import EarlyStopping, StopFile, TimeLimit
from steplib.handlers.throughput import Throughput, count_flops, flops_per_batch
from steplib.handlers.watched_value import BestValue

__all__ = [
    "EMA",
    "BestValue",
    "CSVLogger",
    "ConsoleLogger",
    "EarlyStopping",
    "EvalStep",
    "Evaluator",
    "ExportBest",
    "ExportError",
    "GradNormMonitor",
    "JsonlLogger",
    "LRMonitor",
    "LivePlot",
    "Log",
    "LogWriteError",
    "Logger",
    "MLflowLogger",
    "NonFiniteAlarm",
    "NonFiniteError",
    "Profiler",
    "ProgressBar",
    "Scheduler",
    "Sink",
    "StopFile",
    "TensorBoardLogger",
    "Throughput",
    "TimeLimit",
    "TrainMetrics",
    "WandbLogger",
    "as_metrics",
    "count_flops",
    "eval_mode",
    "evaluate",
    "event_counters",
    "event_record",
    "export_best",
    "export_model",
    "flops_per_batch",
    "full_state_dict",
    "make_eval_step",
]
