"""How close one flat copy comes to the copy floor, per preset and card, over every
recorded shape-matrix run (issue 16's yardstick): reads ``benchmarks/results/**/*.json``
files written by ``shape_matrix.py`` (and the ``torchrefit bench`` rows inside them).

Each torchrefit row of such a run carries, measured in the same process and timed the
same way as the refit (host clock from an idle device to ``synchronize``):
``flat_copy_ms``, one ``cudaMemcpyAsync`` of all the refit's bytes between two flat
buffers, and ``flat_copy_device_ms``, that copy's CUDA-event time; ``floor_ms`` is
2 x bytes / the HBM copy bandwidth measured on a 4 GiB copy in the same run. A refit
cannot beat the flat copy of its bytes, so where ``flat / floor`` is above 1.03 no
refit of that preset can reach 1.03x on that card as the matrix times it.

    python benchmarks/flat_copy_ratios.py            # table over every run found
    python benchmarks/flat_copy_ratios.py --markdown # the same as a Markdown table
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results"


def rows(root: Path = ROOT):
    """(file, card, preset, watch, torchrefit row) for every torchrefit row with a flat copy."""
    for name in sorted(glob.glob(str(root / "**" / "*.json"), recursive=True)):
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, ValueError):
            continue
        shapes = data.get("shapes") if isinstance(data, dict) else None
        for shape in shapes if isinstance(shapes, list) else []:
            for row in shape.get("rows", []) if isinstance(shape, dict) else []:
                if row.get("impl") == "torchrefit" and row.get("flat_copy_ms") and row.get("floor_ms"):
                    card = row.get("device", "?").removeprefix("NVIDIA ").split()[0]
                    yield name, card, shape.get("preset", "?"), shape.get("watch", row.get("watch", "every")), row


def summary(root: Path = ROOT) -> list[dict]:
    """Per (card, preset): runs, and min / median / max of flat / floor, the flat copy's
    device time / floor, and the refit's time / the flat copy's (``watch="every"`` and
    ``"manual"`` rows apart)."""
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _, card, preset, watch, r in rows(root):
        g = groups[(card, preset)]
        g["flat"].append(r["flat_copy_ms"] / r["floor_ms"])
        if r.get("flat_copy_device_ms"):
            g["flat_device"].append(r["flat_copy_device_ms"] / r["floor_ms"])
        g[f"refit_over_flat_{watch}"].append(r["median_ms"] / r["flat_copy_ms"])
        g["floor_ms"].append(r["floor_ms"])
    out = []
    for (card, preset), g in sorted(groups.items()):
        out.append({"card": card, "preset": preset, "rows": len(g["flat"]),
                    **{k: _spread(v) for k, v in sorted(g.items())}})
    return out


def _spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def _cell(spread) -> str:
    if not spread:
        return "-"
    lo, mid, hi = spread
    return f"{mid:.3f} ({lo:.3f}-{hi:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    cols = ["floor_ms", "flat", "flat_device", "refit_over_flat_manual", "refit_over_flat_every"]
    table = summary()
    if args.markdown:
        print("| card | preset | rows | floor ms | flat copy x floor | its device time x floor "
              "| refit x flat copy, manual | refit x flat copy, every |")
        print("|---|---|---|---|---|---|---|---|")
    for s in table:
        cells = [_cell(s.get(c)) for c in cols]
        if args.markdown:
            print(f"| {s['card']} | {s['preset']} | {s['rows']} | " + " | ".join(cells) + " |")
        else:
            print(f"{s['card']:5} {s['preset']:16} rows={s['rows']:3} " + " ".join(f"{c}={v}" for c, v in zip(cols, cells)))


if __name__ == "__main__":
    main()
