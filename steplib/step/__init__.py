"""The step: ``make_train_step``, the wrappers (each ``Step -> Step``), and the composition API
they share with yours (``Part``, ``add_part``, ``Gradients``, the ranks)."""

from steplib.errors import AnomalyError
from steplib.step.accumulate import accumulate
from steplib.step.amp import amp_wrap
from steplib.step.anomaly import detect_anomaly
from steplib.step.clip import clip
from steplib.step.compile import CompileStats, compile_stats, compile_step
from steplib.step.core import Runner, Step, add_part, make_train_step
from steplib.step.ddp import ddp_wrap
from steplib.step.fsdp import fsdp_wrap
from steplib.step.parts import (
    CLIP,
    FINITE,
    HOOK_POINTS,
    NORMALISE,
    TRANSFORM,
    UNSCALE,
    Gradients,
    GradReport,
    GradSync,
    Part,
)
from steplib.step.pipeline import make_pipeline_step, pipeline_stage
from steplib.step.skip import skip_nonfinite
from steplib.step.tap import tap

__all__ = [
    "CLIP",
    "FINITE",
    "HOOK_POINTS",
    "NORMALISE",
    "TRANSFORM",
    "UNSCALE",
    "AnomalyError",
    "CompileStats",
    "GradReport",
    "GradSync",
    "Gradients",
    "Part",
    "Runner",
    "Step",
    "accumulate",
    "add_part",
    "amp_wrap",
    "clip",
    "compile_stats",
    "compile_step",
    "ddp_wrap",
    "detect_anomaly",
    "fsdp_wrap",
    "make_pipeline_step",
    "make_train_step",
    "pipeline_stage",
    "skip_nonfinite",
    "tap",
]
