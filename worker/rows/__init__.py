"""Row tables from a worker (docs/sparse.md): the client's calls and the modules (shardps.nn.Embedding,
EmbeddingBag)."""
