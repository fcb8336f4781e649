"""`python -m probjax_nn.benchmark plot FILE`: PNGs of TFLOP/s against seq, and a Markdown summary.

One PNG per dtype x head_dim (x batch x heads), with a panel per mode x causal and a line per impl (an impl
run with a tag is its own line, "impl [tag]"). The summary beside it gives the device, the versions, the
command, the impls that were missing, and per shape every impl's TFLOP/s, the best peer and the ratio of
each probjax impl to it. A peer is any impl whose name does not start with "probjax".
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import pathlib
from collections.abc import Sequence

from probjax_nn.benchmark._report import command_line, load_report

SHAPE_KEYS = ("dtype", "batch", "heads", "head_dim", "seq", "causal", "mode")
# Decode rows add these (None in attention rows): a dense and a paged cache, or two K, are different shapes.
DECODE_KEYS = ("kv_heads", "new_tokens", "page_size")


def _series(row: dict) -> str:
    return row["impl"] if row.get("tag") is None else f"{row['impl']} [{row['tag']}]"


def _is_probjax(series: str) -> bool:
    return series.startswith("probjax")


def _table(report: dict) -> tuple[list[str], dict[tuple, dict[str, dict]]]:
    """(series in order of first appearance, {shape: {series: row}}); a later row replaces an earlier one."""
    series: dict[str, None] = {}
    shapes: dict[tuple, dict[str, dict]] = collections.defaultdict(dict)
    for row in report["results"]:
        series[_series(row)] = None
        shapes[(*(row[key] for key in SHAPE_KEYS), *(row.get(key) for key in DECODE_KEYS))][_series(row)] = row
    return list(series), shapes


def _shape_order(item) -> tuple:
    """Sorts (shape, ...) items: in order, None (attention rows' decode keys) before any number."""
    return tuple((value is not None, value) for value in item[0])


def _timed(row: dict | None) -> bool:
    """Whether `row` has a TFLOP/s figure (decode rows measured off the GPU hold None)."""
    return row is not None and row.get("tflops") is not None


def _decode_suffix(kv_heads, new_tokens, page_size) -> str:
    if kv_heads is None:
        return ""
    return f"_k{kv_heads}_t{new_tokens}_{'page' + str(page_size) if page_size else 'dense'}"


def _device_name(device: dict) -> str:
    return device["gpu"] or device["device_kind"]


def plot_figures(report: dict, stem: str, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per dtype x batch x heads x head_dim (x kv_heads x new tokens x page size for decode rows);
    returns their paths."""
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("plot needs matplotlib: pip install 'probjax-nn[benchmark]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, shapes = _table(report)
    # tab20 pairs a dark and a light shade: the dark ones first, so that the first ten lines differ most.
    palette = [plt.get_cmap("tab20")(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    colours = {name: palette[i % 20] for i, name in enumerate(names)}
    figures = collections.defaultdict(lambda: collections.defaultdict(list))  # figure -> panel -> rows
    for (dtype, batch, heads, head_dim, seq, causal, mode, *decode), rows in shapes.items():
        for row in rows.values():
            if _timed(row):
                figures[(dtype, batch, heads, head_dim, *decode)][(mode, causal)].append(row)
    paths = []
    for (dtype, batch, heads, head_dim, *decode), panels in sorted(figures.items(), key=_shape_order):
        modes = sorted({mode for mode, _ in panels})
        causals = sorted({causal for _, causal in panels})
        fig, axes = plt.subplots(
            len(modes), len(causals), figsize=(6 * len(causals), 4.2 * len(modes)), squeeze=False, sharex=True
        )
        for (i, mode), (j, causal) in itertools.product(enumerate(modes), enumerate(causals)):
            ax = axes[i][j]
            lines = collections.defaultdict(list)
            for row in panels.get((mode, causal), []):
                lines[_series(row)].append((row["seq"], row["tflops"]))
            for name in names:
                if name in lines:
                    seqs, tflops = zip(*sorted(lines[name]))
                    ax.plot(
                        seqs, tflops, marker="o", markersize=3, color=colours[name], label=name,
                        linestyle="-" if _is_probjax(name) else "--", linewidth=2.2 if _is_probjax(name) else 1.2,
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, {'causal' if causal else 'not causal'}")
            ax.set_xlabel("cache length S" if decode[0] is not None else "seq (T = S)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        title = f"{_device_name(report['device'])}: {dtype}, head_dim {head_dim}, batch {batch}, heads {heads}"
        if decode[0] is not None:
            kv_heads, new_tokens, page_size = decode
            title += f", kv_heads {kv_heads}, {new_tokens} new, {f'page {page_size}' if page_size else 'dense'}"
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / f"{stem}_{dtype}_b{batch}_n{heads}_hd{head_dim}{_decode_suffix(*decode)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if "error" in row:
        return "ERR"
    return f"{row['tflops']:.3g}" if _timed(row) else "-"


def summary(report: dict, stem: str, figures: Sequence[pathlib.Path]) -> str:
    """The Markdown summary: how it was measured, then per shape every impl's TFLOP/s and probjax / best peer."""
    device, config = report["device"], report["config"]
    names, shapes = _table(report)
    probjax = [name for name in names if _is_probjax(name)]
    decode = any(shape[len(SHAPE_KEYS)] is not None for shape in shapes)
    errors = collections.defaultdict(set)
    for row in report["results"]:
        errors[_series(row)].add(row.get("error", ""))
    missing = {
        name: next(iter(texts)) for name, texts in errors.items()
        if len(texts) == 1 and next(iter(texts)).startswith("missing: ")
    }
    lines = [
        f"# {'Decode' if decode else 'Attention'} benchmark: {_device_name(device)}",
        "",
        f"- device: {_device_name(device)}, driver {device['driver']}, {device['gpu_memory_gb']} GB; "
        f"JAX backend {device['backend']} ({', '.join(device['devices'])})",
        f"- versions: jax {device['jax']}, python {device['python']}, torch {device['torch']} "
        f"(CUDA {device['torch_cuda']})",
        f"- command: `{command_line(config)}`",
        f"- data: `{stem}.json`, {len(report['results'])} rows",
        "",
        "TFLOP/s (4 B N T S D per forward; causal counts half; fwd_bwd counts 3.5x the forward, jvp 3x). "
        "ERR: the row holds an error (see the JSON). -: not timed (decode off the GPU). Blank: not run. "
        "Ratios: probjax impl / the best peer.",
        "",
    ]
    if missing:
        lines += ["Missing impls (every row an error):", ""]
        lines += [f"- {name}: {text.removeprefix('missing: ')}" for name, text in missing.items()]
        lines.append("")
    shown = [name for name in names if name not in missing]
    decode_columns = ["K", "new", "page"] if decode else []
    header = ["dtype", "B", "N", "hd", "seq", "causal", "mode", *decode_columns, *shown, "best peer",
              *(f"{p} / best" for p in probjax)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios = collections.defaultdict(list)
    for (dtype, batch, heads, head_dim, seq, causal, mode, *keys), rows in sorted(shapes.items(), key=_shape_order):
        peers = [(row["tflops"], name) for name, row in rows.items() if not _is_probjax(name) and _timed(row)]
        best_tflops, best_name = max(peers) if peers else (None, None)
        kv_heads, new_tokens, page_size = keys
        cells = [dtype, batch, heads, head_dim, seq, "y" if causal else "n", mode]
        if decode:
            cells += [kv_heads, new_tokens, page_size or "dense"]
        cells += [_cell(rows.get(n)) for n in shown]
        cells.append("" if best_name is None else f"{best_name} {best_tflops:.3g}")
        for name in probjax:
            row = rows.get(name)
            if best_tflops and _timed(row):
                ratios[name].append(row["tflops"] / best_tflops)
                cells.append(f"{ratios[name][-1]:.2f}")
            else:
                cells.append("")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if ratios:
        lines += ["", "Geometric mean of the ratios over the shapes that have both:", ""]
        for name, values in ratios.items():
            mean = math.exp(sum(map(math.log, values)) / len(values))
            lines.append(f"- {name} / best peer: {mean:.2f} over {len(values)} shapes")
    if figures:
        lines += ["", "## Plots", ""]
        lines += [f"![{path.stem}]({path.name})" for path in figures]
    return "\n".join(lines) + "\n"


def plot(path: pathlib.Path, out_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Draws `path` (a benchmark JSON): the PNGs and `<stem>.md` in `out_dir` (default: beside the JSON)."""
    report = load_report(path)
    out_dir = path.parent if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = plot_figures(report, path.stem, out_dir)
    markdown = out_dir / f"{path.stem}.md"
    markdown.write_text(summary(report, path.stem, figures))
    return [*figures, markdown]


def plot_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m probjax_nn.benchmark plot",
        description="PNGs of TFLOP/s against seq (a panel per mode x causal, a figure per dtype x head_dim) "
        "and a Markdown summary with probjax / best-peer ratios per shape.",
    )
    parser.add_argument(
        "file", type=pathlib.Path, metavar="FILE", help="a JSON file written by python -m probjax_nn.benchmark"
    )
    parser.add_argument("--out-dir", type=pathlib.Path, default=None, help="default: the folder of FILE")
    args = parser.parse_args(argv)
    try:
        load_report(args.file)
    except OSError as error:
        parser.error(f"argument FILE: cannot read {args.file}: {error.strerror}")
    except ValueError as error:
        parser.error(f"argument FILE: {error}")
    if args.out_dir is not None and args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"argument --out-dir: {args.out_dir} is not a folder")
    for written in plot(args.file, args.out_dir):
        print(f"wrote {written}")
    return 0
