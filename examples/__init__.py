"""Real models on real data, runnable as shardps workers."""
