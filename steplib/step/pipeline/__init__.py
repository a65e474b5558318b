"""The pipeline step: ``make_pipeline_step`` over ``torch.distributed.pipelining``."""

from steplib.step.pipeline.build import make_pipeline_step
from steplib.step.pipeline.runner import PipelineRunner, PipelineSync, pipeline_stage

__all__ = ["PipelineRunner", "PipelineSync", "make_pipeline_step", "pipeline_stage"]
