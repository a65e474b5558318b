r"""Experiment trackers as log sinks: Weights & Biases and MLflow (optional extras).

Both are :class:`~steplib.handlers.logging.Sink`\ s, so they take the same records as the
JSONL, CSV and TensorBoard sinks and compose with them in one
:class:`~steplib.handlers.logging.Log`::

    with WandbLogger(project="exp", config=cfg) as wb, MLflowLogger(
        tracking_uri="sqlite:///runs/mlflow.db", experiment="exp"
    ) as mlf:
        events.on("step_end", Log([wb, mlf], sources=[train.read]), every=50)
        state = run(step, state, loader, events=events)

Every number of a record is logged at the record's ``step``; ``step``, ``micro_step`` and
``time`` are not plotted (``time`` becomes the point's timestamp), a flat list of numbers
(a sweep's, one per copy) is one metric per element (``loss/0``, ``loss/1``, ...), and other
non-numbers (strings, booleans, nested lists) are skipped, as in the TensorBoard sink.

Rank 0 only (``rank_zero_only=True``): on other ranks nothing is imported, no run is created
and ``write`` does nothing. Leaving a ``with`` block on an exception marks the run as failed
(W&B exit code 1, MLflow status ``FAILED``). The packages are imported when a logger is built."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from steplib.distributed import is_main
from steplib.errors import ConfigError, LogWriteError, describe
from steplib.handlers.logging.base import Record, check_keys, plotted
from steplib.handlers.logging.continued import MLFLOW_KEPT, WANDB_ID_KEPT, WANDB_KEPT, TrackerSink


def _check_name(caller: str, label: str, value: Any, example: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{caller}({label}=...) received {describe(value)}; pass a non-empty string, "
            f"e.g. {caller}({label}={example!r})."
        )


def _import(module: str, caller: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"{caller} needs the {module} package, which is not installed ({error}). Install "
            f"the extra: pip install 'steplib[{extra}]'."
        ) from error


class WandbLogger(TrackerSink):
    """Log records to a Weights & Biases run (``pip install 'steplib[wandb]'``).

    ``mode="offline"`` (the default) writes the run under ``dir`` and never touches the
    network; upload it later with ``wandb sync <dir>/wandb/offline-run-...``. Pass
    ``mode="online"`` to stream to the W&B server (after ``wandb login``).

    The run is created with ``reinit="create_new"``: building a second logger (re-running a
    notebook cell) starts a second run and leaves the first one alone; ``close`` finishes
    this logger's run only.

    Args:
        project: the W&B project name.
        mode: ``"offline"``, ``"online"`` or ``"disabled"`` (W&B's own modes).
        dir: the directory W&B writes under (its ``wandb/`` folder); ``None`` is W&B's
            default (the working directory).
        config: hyperparameters to record with the run (a mapping of plain values).
        name: the run's display name (W&B picks one when ``None``).
        keys: the names to log (``None``: every number but the counters ``epoch``,
            ``num_targets``, ``updates``, ...), as for every sink and ``ProgressBar``.
        rank_zero_only: create the run and log on rank 0 only.
        **init_kwargs: more keyword arguments for ``wandb.init`` (``tags``, ``group``,
            ``settings``, ...). ``id=``, ``resume="allow"``: continue that run; W&B drops a
            step it holds, and the first record at one warns.

    Raises:
        ConfigError: a bad argument, or wandb is not installed.
        LogWriteError: W&B could not start the run (the message names the project and dir).

    Example:
        >>> import tempfile
        >>> with WandbLogger(project="doc", dir=tempfile.mkdtemp()) as wb:  # doctest: +SKIP
        ...     wb.write({"step": 1, "loss": 2.0})
        >>> wb.run.settings.sync_file  # doctest: +SKIP
        '/tmp/.../wandb/offline-run-...-<id>/run-<id>.wandb'
    """

    def __init__(
        self,
        *,
        project: str,
        mode: str = "offline",
        dir: str | None = None,  # wandb.init's own name for it
        config: Mapping[str, Any] | None = None,
        name: str | None = None,
        keys: Sequence[str] | None = None,
        rank_zero_only: bool = True,
        **init_kwargs: Any,
    ) -> None:
        _check_name("WandbLogger", "project", project, "my-project")
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(
                f"WandbLogger(mode=...) received {describe(mode)}; W&B's modes are 'offline' "
                "(write locally, sync later), 'online' and 'disabled'."
            )
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError(
                f"WandbLogger(config=...) received {describe(config)}; pass a mapping of "
                "hyperparameters, e.g. config={'lr': 3e-4, 'batch_size': 64}."
            )
        self.project = project
        self.dir = dir
        self.keys = check_keys("WandbLogger", keys)
        self.active = is_main() or not rank_zero_only
        # The wandb Run (.id, .dir, .settings.sync_file, ...), kept after close for reading.
        self.run: Any = None
        self._open = self._continued = False
        if not self.active:
            return
        wandb = _import("wandb", "WandbLogger", "wandb")
        if dir is not None:
            os.makedirs(dir, exist_ok=True)  # wandb.init falls back to /tmp when it is missing
        try:
            self.run = wandb.init(
                project=project,
                mode=mode,
                dir=dir,
                config=dict(config or {}),
                name=name,
                reinit="create_new",
                **init_kwargs,
            )
            self._open = True
        except Exception as error:
            raise LogWriteError(
                f"WandbLogger could not start a run for project {project!r} in dir {dir!r}: "
                f"{error!r}. Check that the directory is writable; for mode='online' run "
                "`wandb login` first, or use mode='offline'."
            ) from error
        # A run continued by id= (online) starts at the step after the last it holds (W&B's
        # starting_step) and drops a lower one: the first record warns if it is one.
        resumed = getattr(self.run, "resumed", False)  # W&B's, set for a run continued by id=
        held = getattr(self.run, "starting_step", 0) - 1 if resumed else -1
        self._continued = held >= 0
        if self._continued:
            self.continue_run({"_step": held})  # W&B keeps one step counter for all

    def write(self, record: Record) -> None:
        """Log every number of ``record`` at its ``step``.

        W&B keeps one row per step: values logged for the same step (train and evaluation
        records) are merged; a step lower than one already logged is dropped by W&B.

        Raises:
            LogWriteError: the logger is closed, or W&B refused the record.
        """
        if not self.active:
            return
        if not self._open:
            raise LogWriteError(
                f"WandbLogger(project={self.project!r}) is closed; it cannot write {record!r}. "
                "Create a new logger, or keep the `with WandbLogger(...)` block open."
            )
        self.check_step(record, WANDB_ID_KEPT if self._continued else WANDB_KEPT)
        self._continued = False  # W&B's last step is now one this logger wrote (merged at)
        try:
            self.run.log(plotted(record, self.keys), step=int(record.get("step", 0)))
        except Exception as error:
            raise LogWriteError(
                f"WandbLogger(project={self.project!r}) could not log {record!r}: {error!r}."
            ) from error

    @property
    def closed(self) -> bool:
        """The W&B run was finished (``close``, or the end of the ``with`` block)."""
        return self.active and not self._open

    def close(self, *, exit_code: int = 0) -> None:
        """Finish the run; calling it again does nothing.

        W&B's service process writes the run's last records shortly after this returns (at the
        latest when the Python process exits); sync or read the offline files after that.

        Args:
            exit_code: 0 for a finished run, non-zero to mark it failed.

        Raises:
            LogWriteError: W&B could not finish the run.
        """
        if not self._open:
            return
        self._open = False
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as error:
            raise LogWriteError(
                f"WandbLogger(project={self.project!r}) could not finish its run: {error!r}."
            ) from error

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


class MLflowLogger(TrackerSink):
    """Log records to an MLflow run (``pip install 'steplib[mlflow]'``).

    Uses an ``MlflowClient`` bound to ``tracking_uri``, never MLflow's global active run, so
    two loggers (or a re-run notebook cell) do not interfere. The experiment is created when
    it does not exist.

    Tracking URIs: ``http://host:5000`` for a tracking server, ``sqlite:///path/mlflow.db``
    for a local database (full ``mlflow`` package), or ``file:///path/mlruns`` for the plain
    file store, which MLflow 3 keeps in maintenance mode: it refuses it unless the
    environment sets ``MLFLOW_ALLOW_FILE_STORE=true``.

    Args:
        tracking_uri: where MLflow stores the run.
        experiment: the experiment's name.
        run_name: the run's name (MLflow picks one when ``None``).
        run_id: continue this run (``logger.run_id`` of an earlier logger: a run resumed
            after a kill), as MLflow's ``start_run(run_id=...)`` does: marked running again,
            its metrics continued; it must be in ``experiment``. ``None``: a new run. The
            steps it holds of a metric are left out of this run's (one value per step; a
            ``UserWarning`` names them).
        params: hyperparameters to record as the run's parameters.
        tags: tags for the run.
        keys: the names to log (``None``: every number but the counters ``epoch``,
            ``num_targets``, ``updates``, ...), as for every sink and ``ProgressBar``.
        rank_zero_only: create the run and log on rank 0 only.

    Raises:
        ConfigError: a bad argument, ``run_id`` of another experiment, or mlflow is not
            installed.
        LogWriteError: MLflow could not open the store, or create or find the run (names
            the URI).

    Example:
        >>> import tempfile
        >>> uri = "sqlite:///" + tempfile.mkdtemp() + "/mlflow.db"
        >>> with MLflowLogger(tracking_uri=uri, experiment="doc") as mlf:  # doctest: +SKIP
        ...     mlf.write({"step": 1, "loss": 2.0})
    """

    def __init__(
        self,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        keys: Sequence[str] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        _check_name("MLflowLogger", "tracking_uri", tracking_uri, "sqlite:///runs/mlflow.db")
        _check_name("MLflowLogger", "experiment", experiment, "my-experiment")
        if run_id is not None:
            _check_name("MLflowLogger", "run_id", run_id, "0a1b2c...")
        for label, value in (("params", params), ("tags", tags)):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(
                    f"MLflowLogger({label}=...) received {describe(value)}; pass a mapping, "
                    f"e.g. {label}={{'lr': '3e-4'}}."
                )
        self.tracking_uri = tracking_uri
        self.keys = check_keys("MLflowLogger", keys)
        self.active = is_main() or not rank_zero_only
        self.run_id: str | None = None
        if not self.active:
            return
        tracking = _import("mlflow.tracking", "MLflowLogger", "mlflow")
        entities = _import("mlflow.entities", "MLflowLogger", "mlflow")
        self._metric = entities.Metric
        self._param = entities.Param
        self._tag = entities.RunTag
        try:
            self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            if run_id is not None:  # MLflow's start_run(run_id=...), through this client
                self.run_id = self._continued(run_id, experiment, found, run_name, tags or {})
            else:
                experiment_id = (
                    found.experiment_id if found else self.client.create_experiment(experiment)
                )
                run = self.client.create_run(
                    experiment_id, run_name=run_name, tags=dict(tags or {})
                )
                self.run_id = run.info.run_id
            if params:
                self.client.log_batch(
                    self.run_id,
                    params=[self._param(str(k), str(v)) for k, v in params.items()],
                )
        except ConfigError:
            raise
        except Exception as error:
            raise LogWriteError(
                f"MLflowLogger could not {'create a run' if run_id is None else 'find the run'}"
                f"{'' if run_id is None else f' {run_id!r}'} in experiment {experiment!r} at "
                f"{tracking_uri!r}: {error!r}. Check the URI (for a local directory use "
                "'sqlite:///path/mlflow.db', or 'file:///path' with MLFLOW_ALLOW_FILE_STORE=true)."
            ) from error

    def _continued(
        self, run_id: str, experiment: str, found: Any, name: str | None, tags: Mapping[str, Any]
    ) -> str:
        """Mark the run ``run_id`` of ``experiment`` (``found``) running again, as MLflow's
        ``start_run(run_id=...)`` does, and add ``tags``."""
        run = self.client.get_run(run_id)
        if found is None or run.info.experiment_id != found.experiment_id:
            where = "in another experiment"
        elif run.info.lifecycle_stage == "deleted":
            where = "deleted"
        else:
            self.client.update_run(run_id, status="RUNNING", name=name)
            if tags:
                self.client.log_batch(run_id, tags=[self._tag(k, str(v)) for k, v in tags.items()])
            history = self.client.get_metric_history  # the steps it holds: left out in write
            held = {k: max(m.step for m in history(run_id, k)) for k in run.data.metrics}
            self.continue_run(held)
            return run_id
        raise ConfigError(
            f"MLflowLogger(run_id={run_id!r}, experiment={experiment!r}) names a run {where}: "
            "a run is continued in the experiment it was logged to. Pass that experiment (or "
            "restore the deleted run), or run_id=None for a new run."
        )

    def write(self, record: Record) -> None:
        """Log every number of ``record`` at its ``step``, in one ``log_batch`` call.

        Raises:
            LogWriteError: the logger is closed, or MLflow refused the record (e.g. a metric
                name with characters MLflow does not allow).
        """
        if not self.active:
            return
        if self.run_id is None:
            raise LogWriteError(
                f"MLflowLogger({self.tracking_uri!r}) is closed; it cannot write {record!r}. "
                "Create a new logger, or keep the `with MLflowLogger(...)` block open."
            )
        self.check_step(record, MLFLOW_KEPT)
        step = int(record.get("step", 0))
        # MLflow timestamps are integer milliseconds; the record's time is unix seconds.
        stamp = int(float(record.get("time", 0.0)) * 1000)
        values = plotted(record, self.keys)
        names = self.new_names(step, values)  # what its run held before this run is left out
        metrics = [self._metric(n, float(values[n]), stamp, step) for n in names]
        if not metrics:
            return
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as error:
            raise LogWriteError(
                f"MLflowLogger({self.tracking_uri!r}) could not log {record!r}: {error!r}. "
                "MLflow metric names allow letters, digits and _ - . / and spaces."
            ) from error

    @property
    def closed(self) -> bool:
        """The MLflow run was ended (``close``, or the end of the ``with`` block)."""
        return self.active and self.run_id is None

    def close(self, *, status: str = "FINISHED") -> None:
        """End the run with ``status``; calling it again does nothing.

        Args:
            status: MLflow's run status, ``"FINISHED"``, ``"FAILED"`` or ``"KILLED"``.

        Raises:
            LogWriteError: MLflow could not record the end of the run.
        """
        run_id, self.run_id = self.run_id, None
        if run_id is None:
            return
        try:
            self.client.set_terminated(run_id, status=status)
        except Exception as error:
            raise LogWriteError(
                f"MLflowLogger({self.tracking_uri!r}) could not end run {run_id}: {error!r}."
            ) from error

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(status="FINISHED" if exc_type is None else "FAILED")
