"""Pipeline parallelism, the Ray-free part: schedules, partitioning, a stage's runtime, activation offload.

``shardps.ray.Pipeline`` runs it on Ray actors; everything here runs in one
process too (``LocalPipeline``), which is how the transparency tests check it.
"""
