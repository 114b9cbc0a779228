"""The names a pipeline's settings accept, apart so that ``shardps ray``'s parser offers them without
importing torch (shardps/cli_ray.py)."""

from __future__ import annotations

#: How a saved activation may be encoded when it is offloaded (worker/pipeline/offload.py).
ENCODINGS = ("bf16", "fp16", "relu-mask")
#: Activation recomputation: every micro-batch's forward again in its backward, all but the last
#: micro-batch's, or none (worker/pipeline/stage.py).
CHECKPOINT_MODES = ("always", "except_last", "never")
