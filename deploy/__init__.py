"""How shardps comes up: local processes (the embedded default) and, later, compose and Ray."""
