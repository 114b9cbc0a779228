"""Streamed weights (DistributedOptimizer(stream=)): the settings and plan (Stream), the streamer, memory given
back to the system."""
