"""Metric logs: :class:`Log` and its sinks (JSONL, CSV, TensorBoard, console, W&B, MLflow).

``base`` holds what every sink shares (:class:`Logger`, :class:`Log`, :func:`event_record`);
each other module is one kind of destination.
"""

from steplib.handlers.logging.base import (
    ConsoleLogger,
    CSVLogger,
    JsonlLogger,
    Log,
    Logger,
    LogWriteError,
    Record,
    Source,
    TensorBoardLogger,
    event_counters,
    event_record,
)
from steplib.handlers.logging.trackers import MLflowLogger, WandbLogger

__all__ = [
    "CSVLogger",
    "ConsoleLogger",
    "JsonlLogger",
    "Log",
    "LogWriteError",
    "Logger",
    "MLflowLogger",
    "Record",
    "Source",
    "TensorBoardLogger",
    "WandbLogger",
    "event_counters",
    "event_record",
]
