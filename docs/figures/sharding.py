"""The sharding diagram: 2 ranks, 3 units, at the three moments of a unit's step (drawn at build time)."""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

UNITS, COLORS = 3, ["tab:blue", "tab:orange", "tab:green"]
fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
titles = [
    "between uses: each rank keeps its shard",
    "forward/backward of unit 1: all-gather",
    "after backward of unit 1: reduce-scatter",
]
for ax, title in zip(axes, titles):
    ax.set(xlim=(0, 10), ylim=(0, 10), title=title)
    ax.title.set_fontsize(9)
    ax.axis("off")
    for rank, y in enumerate((5.5, 0.5)):
        ax.text(0, y + 3.9, f"rank {rank}", fontsize=8)
        for unit in range(UNITS):
            x = 0.5 + unit * 3.2
            gathered = title.startswith("forward") and unit == 1
            for half in range(2):  # the unit's weight: two halves of rows
                held = gathered or half == rank
                ax.add_patch(
                    Rectangle((x, y + (1 - half) * 1.6), 2.6, 1.5, color=COLORS[unit], alpha=0.9 if held else 0.12)
                )
            if title.startswith("after") and unit == 1:  # this rank's slice of the averaged gradient
                ax.add_patch(
                    Rectangle(
                        (x + 0.4, y + (1 - rank) * 1.6 + 0.3),
                        1.8,
                        0.9,
                        fill=False,
                        hatch="////",
                        edgecolor="black",
                        lw=0.8,
                    )
                )
            ax.text(x + 1.3, y - 0.4, f"unit {unit}", fontsize=7, ha="center")
fig.text(
    0.5,
    0.01,
    "solid: held in memory; faded: held by the other rank; hatched: this rank's slice of the "
    "gradient, summed over ranks",
    ha="center",
    fontsize=8,
)
fig.tight_layout(rect=(0, 0.05, 1, 1))
