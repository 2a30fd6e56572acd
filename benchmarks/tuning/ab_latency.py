"""A/B the engine's decode latency across source trees on one GPU.

Each tree (a directory holding ``vllm/`` and ``benchmarks/``, or a ``.tgz``
of them) runs its own ``benchmarks/benchmark_latency.py`` in a process of
its own, with only that tree on ``PYTHONPATH``. Runs go in turn (A B A B
...), so that the card's drift hits every tree alike; the table gives each
tree's TPOT per run, its best, and that best over the first tree's.

The device machine gets a copy of the working tree without ``.git``, so
pack the revisions to compare here first::

    git archive HEAD~1 vllm benchmarks | gzip > devrun/before.tgz
    # on the device, from the repository root:
    python benchmarks/tuning/ab_latency.py devrun/before.tgz . --quantization fp8 none
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def unpacked(tree: str, into: Path) -> Path:
    """``tree`` as a directory: archives are extracted under ``into``."""
    path = Path(tree).resolve()
    if path.is_dir():
        return path
    out = into / f"tree{len(list(into.iterdir()))}"
    with tarfile.open(path) as archive:
        archive.extractall(out, filter="data")
    return out


def run_latency(
    tree: Path, name: str, quantization: str, args: argparse.Namespace
) -> dict:
    """One ``benchmark_latency`` run of ``tree`` (given as ``name``): its
    JSON row."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [
            sys.executable, str(tree / "benchmarks" / "benchmark_latency.py"),
            "--preset", args.preset, "--batch-size", str(args.batch_size),
            "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-iters", str(args.num_iters),
            "--output-json", result.name,
        ]  # fmt: skip
        if quantization != "none":
            command += ["--quantization", quantization]
        path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
        env = os.environ | {"PYTHONPATH": path}
        run = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, timeout=900
        )
        if run.returncode:
            raise RuntimeError(f"{name} ({quantization}):\n{run.stderr[-3000:]}")
        report = json.loads(Path(result.name).read_text())
    return report["rows"][0] | {"device": report["device"]}


def write_runs(
    path: Path, names: list[str], runs: dict[tuple[str, int], list[dict]]
) -> None:
    table = [
        {"quantization": q, "tree": names[i], "runs": rows}
        for (q, i), rows in runs.items()
    ]
    path.write_text(json.dumps(table, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="directories or .tgz archives")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", "fp8", "w4a16", "w4a8"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=2)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected >= 1, got {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        trees = [unpacked(tree, Path(tmp)) for tree in args.trees]
        runs: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.repeats):
            for quantization in args.quantization:
                for i, tree in enumerate(trees):
                    row = run_latency(tree, args.trees[i], quantization, args)
                    runs.setdefault((quantization, i), []).append(row)
                    if args.output_json:  # what finished survives a later failure
                        write_runs(args.output_json, args.trees, runs)
                    tpot = row["tpot_ms"]
                    print(f"{quantization} {args.trees[i]}: TPOT {tpot:.3f} ms")
    device = runs[(args.quantization[0], 0)][0]["device"]
    print(f"\ndevice: {device}; {args.preset}, batch {args.batch_size}, "
          f"{args.input_len} in / {args.output_len} out")  # fmt: skip
    print("| quantization | tree | TPOT ms (each run) | best | best / first tree's "
          "| best / bound |\n|---|---|---|--:|--:|--:|")  # fmt: skip
    for quantization in args.quantization:
        first = min(r["tpot_ms"] for r in runs[(quantization, 0)])
        for i, name in enumerate(args.trees):
            rows = runs[(quantization, i)]
            best = min(r["tpot_ms"] for r in rows)
            each = " / ".join(f"{r['tpot_ms']:.3f}" for r in rows)
            of_bound = best / rows[0]["bound_ms"]
            print(f"| {quantization} | {name} | {each} | {best:.3f} | "
                  f"{best / first:.3f} | {of_bound:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
