"""The job as a worker takes part in it: heartbeats, recovery after a rollback, the rollback decision, what the
shards say of the job."""
