"""benchmarks/cluster.py's two figures: step time against server hosts, and one step's link timeline."""

from __future__ import annotations

from typing import Any


def plot(path: str, table: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for link in sorted({t["link_mbit"] for t in table}):
        pts = sorted((t["k"], t["step_s"], t["formula_s"]) for t in table if t["link_mbit"] == link
                     and t["system"] == "shardps" and t["n"] == 4 and t["sync"] == "bsp" and t["wire"] == "fp32"
                     and t["window"] and t["compress"] == "none")
        line = ax.plot([k for k, _, _ in pts], [s for _, s, _ in pts], "o-", label=f"shardps bsp, {link} Mbit/s")
        ax.plot([k for k, _, _ in pts], [f for _, _, f in pts], "--", color=line[0].get_color(),
                label=f"formula, {link} Mbit/s")
        for t in table:
            if t["link_mbit"] == link and t["system"] == "ddp" and t["n"] == 4:
                ax.axhline(t["step_s"], color=line[0].get_color(), linestyle=":", label=f"DDP, {link} Mbit/s")
    ax.set_xlabel("server hosts k (0: a server on each worker host)")
    ax.set_ylabel("step (s)")
    ax.set_title("n = 4 workers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_timeline(path: str, samples: list[list[float]], link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the rate over bins of 50 ms: a 5 ms sample is mostly tbf's bursts, not the link's rate
    bins = [samples[0]]
    for s in samples[1:]:
        if s[0] - bins[-1][0] >= 0.05 or s is samples[-1]:
            bins.append(s)
    rate = [((bins[i][0] + bins[i - 1][0]) / 2, (bins[i][1] - bins[i - 1][1]) * 8e-6 / (bins[i][0] - bins[i - 1][0]),
             (bins[i][2] - bins[i - 1][2]) * 8e-6 / (bins[i][0] - bins[i - 1][0])) for i in range(1, len(bins))]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([r[0] for r in rate], [r[1] for r in rate], label="uplink (gradients up)")
    ax.plot([r[0] for r in rate], [r[2] for r in rate], label="downlink (weights down)")
    ax.set_xlabel("s into the step")
    ax.set_ylabel("Mbit/s")
    ax.set_title(f"worker 0's link in one bsp step, {link}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
