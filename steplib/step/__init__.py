"""Step builders and wrappers: each wrapper is ``Step -> Step``."""

from steplib.step.accumulate import accumulate
from steplib.step.amp import amp_wrap
from steplib.step.anomaly import AnomalyError, detect_anomaly
from steplib.step.clip import clip
from steplib.step.compile import CompileStats, compile_step
from steplib.step.core import GradSync, Step, make_train_step
from steplib.step.ddp import ddp_wrap
from steplib.step.fsdp import fsdp_wrap
from steplib.step.pipeline import PipelineStep, make_pipeline_step
from steplib.step.skip import skip_nonfinite
from steplib.step.tap import tap

__all__ = [
    "AnomalyError",
    "CompileStats",
    "GradSync",
    "PipelineStep",
    "Step",
    "accumulate",
    "amp_wrap",
    "clip",
    "compile_step",
    "ddp_wrap",
    "detect_anomaly",
    "fsdp_wrap",
    "make_pipeline_step",
    "make_train_step",
    "skip_nonfinite",
    "tap",
]
