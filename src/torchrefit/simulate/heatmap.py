"""Draw a refit's rank x rank traffic matrix (matplotlib, imported only when asked)."""

from __future__ import annotations

from .traffic import Traffic

__all__ = ["draw_heatmap"]

_CELLS = 256  # at most this many cells a side: a pixel per rank pair is lost on screen


def draw_heatmap(moves: Traffic, path: str, title: str) -> None:
    """Write a PNG of bytes sent from each source rank (rows) to each destination rank
    (columns), local copies on the diagonal. Raises ImportError saying what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed on a cluster node
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError as e:
        raise ImportError(
            f"--heatmap needs matplotlib ({e}); install it with: pip install 'torchrefit[bench]'"
        ) from None
    w = moves.world
    k = -(-w // _CELLS)  # ranks per cell: a 1024-rank world has cells of 4 x 4 ranks
    n = -(-w // k)
    grid = [[0.0] * n for _ in range(n)]
    for (s, d), nbytes in moves.pairs.items():
        grid[s // k][d // k] += nbytes / 1e9
    for r, b in enumerate(moves.local):
        grid[r // k][r // k] += b / 1e9
    peak = max((max(row) for row in grid), default=0.0)
    fig, ax = plt.subplots(figsize=(8, 7), dpi=120)
    floor = max(peak * 1e-4, 1e-9)
    masked = [[v if v > 0 else float("nan") for v in row] for row in grid]
    image = ax.imshow(masked, cmap="viridis", interpolation="nearest", origin="upper",
                      extent=(0, n * k, n * k, 0),
                      norm=LogNorm(vmin=floor, vmax=max(peak, floor * 10)))
    ax.set_xlabel("destination rank")
    ax.set_ylabel("source rank")
    ax.set_title(title, fontsize=9)
    what = f"GB per {k} x {k} ranks" if k > 1 else "GB"
    fig.colorbar(image, ax=ax, label=f"{what} (log scale; diagonal: local copies)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
