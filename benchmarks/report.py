"""Write the GPU section of BENCHMARKS.md from the JSON files of a reference run.

    python benchmarks/report.py benchmarks/results/h200/fp8 > /tmp/gpu.md

Each table row is one configuration and variant from ``torchrefit bench --json``.
"""

from __future__ import annotations

import json
import pathlib
import sys

from torchrefit._util.format import format_bytes


def _gb(n) -> str:
    return "-" if not n else f"{n / 1e9:.2f} GB"


def _x(v, digits=3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _watch(row: dict) -> str:
    """Rows refitted with ``Refitter(watch="manual")`` say so (older JSONs have no key)."""
    return " (watch manual)" if row.get("watch") == "manual" else ""


def table(path: pathlib.Path) -> str:
    data = json.loads(path.read_text())
    rows = data["configs"]
    r0 = rows[0]
    lines = [
        f"**{r0['label']}** — {r0['params'] / 1e9:.2f} B params, {r0['world']} process(es), "
        f"{r0['device']}, torch {r0['torch']}, copy bandwidth {_x(r0['copy_bandwidth_gbs'], 0)} GB/s, "
        f"warmup {r0['warmup']}, iters {r0['iters']}. `{data['command']}`",
        "",
        "| impl | variant | transport | local | remote | median ms | mean ± sd ms | min-max ms | floor ms "
        "| x floor | x megatron | host ms | host cold ms | first refit s | peak extra |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['variant']}{_watch(r)} | {r['transport']} | {_gb(r.get('bytes_local'))} | "
            f"{_gb(r.get('bytes_remote'))} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} ± {r['stddev_ms']:.2f} | "
            f"{r['min_ms']:.2f}-{r['max_ms']:.2f} | {_x(r.get('floor_ms'), 2)} | {_x(r.get('ratio_to_floor'))} | "
            f"{_x(r.get('ratio_to_megatron'))} | {_x(r.get('host_ms'))} | {_x(r.get('host_cold_ms'))} | "
            f"{r['first_refit_s']:.3f} | "
            f"{format_bytes(r['peak_extra_bytes'], digits=1)} |")
    return "\n".join(lines)


def main(folder: str) -> None:
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        if "configs" in data:
            print(table(path))
            print()


if __name__ == "__main__":
    main(sys.argv[1])
