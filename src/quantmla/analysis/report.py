"""Outputs of ``quantmla analyze``: a terminal table, JSON, CSV and a per-layer figure."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.table import Table

from quantmla.analysis.sensitivity import AnalysisReport


def rows(report: AnalysisReport) -> list[dict]:
    """One flat row per layer (CSV columns)."""
    out = []
    for lr in report.layers:
        row = {"layer": lr.layer, "seconds": round(lr.seconds, 3)}
        for shape in report.config.shapes:
            for path in ("content", "rope"):
                d = lr.results[path][shape]
                for k in ("response", "avg_sensitivity", "allocation", "coupling", "kappa", "cache_nmse"):
                    row[f"{path}_{shape}_{k}"] = d[k]
            row[f"ratio_{shape}"] = lr.ratio(shape)
        for path in ("content", "rope"):
            row[f"{path}_linear_check"] = lr.linear_check[path]["ratio"]
        out.append(row)
    return out


def table(report: AnalysisReport, title: str) -> Table:
    t = Table(
        title=title,
        caption="C: content latent, R: RoPE key; response = NMSE(out)/NMSE(cache); "
        "k*sens/alloc/coup: its three factors (first shape); lin.: measured/linearised at small NMSE",
    )
    t.add_column("layer", justify="right")
    for shape in report.config.shapes:
        tag = "gauss" if shape == "gaussian" else "quant"
        for col in ("C", "R", "R/C"):
            t.add_column(f"{col} {tag}", justify="right")
    t.add_column("C: k*sens/alloc/coup", justify="right")
    t.add_column("R: k*sens/alloc/coup", justify="right")
    t.add_column("lin. C,R", justify="right")
    first = report.config.shapes[0]
    for lr in report.layers:
        cells = [str(lr.layer)]
        for shape in report.config.shapes:
            c, r = lr.results["content"][shape]["response"], lr.results["rope"][shape]["response"]
            cells += [f"{c:.3f}", f"{r:.3f}", f"{lr.ratio(shape):.2f}x"]
        for path in ("content", "rope"):
            d = lr.results[path][first]
            cells.append(f"{d['kappa'] * d['avg_sensitivity']:.3f}/{d['allocation']:.2f}/{d['coupling']:.2f}")
        lc = lr.linear_check
        cells.append(f"{lc['content']['ratio']:.3f},{lc['rope']['ratio']:.3f}")
        t.add_row(*cells)
    model = report.model_level()
    cells = ["mean"]
    for shape in report.config.shapes:
        m = model[shape]
        cells += [f"{m['content']:.3f}", f"{m['rope']:.3f}", f"{m['ratio']:.2f}x"]
    t.add_row(*cells, "", "", "", style="bold")
    return t


def figure(report: AnalysisReport, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [lr.layer for lr in report.layers]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for shape, style in zip(report.config.shapes, ("-", "--"), strict=False):
        ax.plot(
            layers,
            [lr.results["content"][shape]["response"] for lr in report.layers],
            "o" + style,
            color="tab:blue",
            label=f"content ({shape})",
        )
        ax.plot(
            layers,
            [lr.results["rope"][shape]["response"] for lr in report.layers],
            "s" + style,
            color="tab:red",
            label=f"RoPE ({shape})",
        )
        ax2.plot(layers, [lr.ratio(shape) for lr in report.layers], "d" + style, color="k", label=shape)
    ax.set_ylabel("NMSE(out) / NMSE(cache)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_ylabel("RoPE / content")
    ax2.set_xlabel("MLA layer (cache index)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def write(report: AnalysisReport, out: Path, title: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "analysis.json", "csv": out / "analysis.csv", "png": out / "analysis.png"}
    files["json"].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    data = rows(report)
    with files["csv"].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(data[0]))
        w.writeheader()
        w.writerows(data)
    figure(report, files["png"], title)
    return files
