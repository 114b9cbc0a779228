"""Server time to answer every worker's Pull of one bsp round: shared framing vs one framing per Pull.

    .venv/bin/python benchmarks/pull_sharing.py [--mb 50] [--workers 4] [--repeats 5]

One ShardStore (no network) holding --mb MB of fp32 weights answers
--workers Pulls of the same version, as after a bsp barrier, the way the
Pull handler asks (``read(..., messages=True)``): once as shardps does
(the first Pull frames the responses, the others share them while it still
sends them) and once with the shared framing dropped before every Pull
(what each Pull cost before). Each Pull's responses are all taken, as the
Pull handler sends them (a large Pull's are framed by a thread of its own,
see server/datapath/reader.py). Prints the median milliseconds of each and the ratio
(shared / per-Pull time; lower is better).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardps import optim
from shardps.protos import codec
from shardps.server.store import ShardStore, TensorSpec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a `shardps server` on 2 cores
    n = int(args.mb * 1e6 / 4)
    rows = max(1, n // 1024)
    st = ShardStore(0, 1, sync="bsp", num_workers=args.workers)
    names = [f"t{i}" for i in range(8)]
    st.path.register_tensors([TensorSpec(nm, (rows // 8, 1024), codec.to_wire_dtype(torch.float32), optim.SGD(lr=0.0),
                                    ((0, rows // 8 * 1024),)) for nm in names],
                        {(nm, 0): torch.randn(rows // 8 * 1024) for nm in names})

    def round_ms(shared: bool) -> float:
        st.reader.cache.clear()
        streaming = []  # every Pull's responses stay referenced, as while the Pulls send them
        t0 = time.perf_counter()
        for _ in range(args.workers):
            if not shared:
                st.reader.cache.clear()
            framed = st.reader.read(names, None, messages=True)[1]
            streaming.append((framed, [msg for *_, msg in framed]))
        return (time.perf_counter() - t0) * 1e3

    shared, each = [], []
    for _ in range(args.repeats):
        each.append(round_ms(False))
        shared.append(round_ms(True))
    a, b = statistics.median(shared), statistics.median(each)
    print(f"{args.mb:g} MB, {args.workers} Pulls of one version: shared framing {a:.1f} ms, "
          f"one framing per Pull {b:.1f} ms, ratio {a / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
