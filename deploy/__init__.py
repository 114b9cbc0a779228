"""How shardps comes up: local processes (the embedded default), docker-compose, and Ray."""
