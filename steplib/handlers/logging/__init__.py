"""Metric logs: :class:`Log` and its sinks (JSONL, CSV, TensorBoard, console, W&B, MLflow).

``base`` holds what every sink shares (:class:`Sink`, :func:`event_record`); ``log`` the
:class:`Log` handler that writes to sinks;
``file_sink`` the base of the sinks that write one file; ``continued`` what a log continued at
a resume drops; each other module is one destination.
"""

from steplib.errors import LogWriteError
from steplib.handlers.logging.base import (
    Logger,
    Record,
    Sink,
    Source,
    event_counters,
    event_record,
)
from steplib.handlers.logging.console import ConsoleLogger
from steplib.handlers.logging.csv import CSVLogger
from steplib.handlers.logging.file_sink import FileSink
from steplib.handlers.logging.jsonl import JsonlLogger
from steplib.handlers.logging.log import Log
from steplib.handlers.logging.tensorboard import TensorBoardLogger
from steplib.handlers.logging.trackers import MLflowLogger, WandbLogger

__all__ = [
    "CSVLogger",
    "ConsoleLogger",
    "FileSink",
    "JsonlLogger",
    "Log",
    "LogWriteError",
    "Logger",
    "MLflowLogger",
    "Record",
    "Sink",
    "Source",
    "TensorBoardLogger",
    "WandbLogger",
    "event_counters",
    "event_record",
]
