"""Pipeline parallelism, the Ray-free part: schedules, the plan of a step and the walker that runs it,
partitioning, a stage's runtime and its parameter-server side, activation offload.

``shardps.ray.Pipeline`` drives the same plan and walker with Ray actors as
the stages; everything here runs in one process too (``LocalPipeline``),
which is how the transparency tests check it.
"""
