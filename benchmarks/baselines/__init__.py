"""Baselines that benchmarks/peers.py runs beside shardps: DDP (gloo) and a Ray object-store parameter server."""
