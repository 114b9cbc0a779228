"""``python -m shardps.deploy.ray.stop_stale``: end local Ray clusters whose owner is gone.

``make test`` runs it after the suite, whatever the outcome: a test run
killed before its fixtures could stop their ``RayLocalCluster`` leaves no
Ray process behind for the next one.
"""

from shardps.deploy.ray.local import stop_stale

if __name__ == "__main__":
    for d in stop_stale():
        print(f"stopped the stale Ray cluster of {d}")
