"""``compile_step``: a runner that runs the step's phases as compiled graphs."""

from steplib.step.compile.graphs import CompileStats
from steplib.step.compile.runner import CompiledRunner, compile_stats, compile_step

__all__ = ["CompileStats", "CompiledRunner", "compile_stats", "compile_step"]
