"""The training side: PSClient (routing, parallel push/pull) and DistributedOptimizer."""
