"""strategy=pipeline: the model split by layers into stages, microbatches through PyTorch's schedules.

The split is traced from the model's forward (Note [pipeline partitioning] in
partition.py, Note [tracing for the pipeline] in trace.py), so every stage keeps
the original parameter names and skip connections that cross stages are
carried (Note [stage chain] in chain.py); Hugging Face models are cut at their
nested decoder / encoder blocks (Note [nested blocks] in parallel/blocks.py).
Weights tied across stages (an embedding shared with the output head) live as
one copy per stage; their gradients are summed over the copies before the step,
so the copies stay equal.

Modules, each importing only those above it:

    schedules   schedule names, stage placement, constraints, analytic bubbles
    partition   what each block costs, and the balanced split
    chain       the traced split rewritten so each stage feeds only the next
    trace       the forward traced on meta and cut before the chosen blocks
    split       where the model is cut: boundaries chosen, the forward traced
    check       the config checks parallel.validate calls
    stages      this rank's stages: built, materialized, tied, timed
    engine      build_pipeline and the PipelineEngine it returns

strategy=hybrid builds on `build_pipeline` (parallel.strategies.hybrid); nothing
here imports it.
"""
from parallel.strategies.pipeline.check import check_pipeline, check_split
from parallel.strategies.pipeline.engine import build_pipeline
from parallel.strategies.pipeline.split import plan_split

__all__ = ["build_pipeline", "check_pipeline", "check_split", "plan_split"]
