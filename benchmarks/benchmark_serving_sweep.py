"""Serving against offline at the same load, over a sweep of concurrency.

One ``vllm serve`` (``--max-num-seqs`` = the largest concurrency) is driven
by ``benchmark_serving.py`` with ``c`` requests in flight, for each ``c``;
then the offline engine runs the same load in a fresh process each:
``benchmark_throughput.py`` with ``--max-num-seqs c`` on as many requests of
the same lengths, and at ``c = 1`` ``benchmark_latency.py``'s batch-1 TPOT.
The table shows what the HTTP path costs: serving / offline output tokens/s
and serving TPOT / engine TPOT. Writes ``sweep.json`` (the table, every
run's own numbers and the server's engine-loop timing lines), ``sweep.png``
(throughput and TPOT against concurrency) and ``server.log`` to
``--output-dir``.

    python benchmarks/benchmark_serving_sweep.py --preset qwen3-30b-a3b \\
        --concurrency 1 64 256 --input-len 512 --output-len 256

The default ``tiny`` preset runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm.benchmarks.presets import MODEL_PRESETS, write_preset_config
from vllm.benchmarks.utils import add_parallel_args, parallel_flags
from vllm.entrypoints.serve_process import ServeProcess

HERE = Path(__file__).resolve().parent


@dataclass
class SweepRow:
    concurrency: int
    requests: int
    serving_output_tok_s: float
    offline_output_tok_s: float
    serving_tpot_ms: float  # median over requests
    offline_tpot_ms: float | None  # the engine's batch-1 TPOT; c = 1 only
    serving_ttft_ms: float  # median


def num_requests(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_requests, args.waves * concurrency)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine's flags, as ``vllm serve`` and ``benchmark_throughput.py``
    spell them alike."""
    flags = ["--dtype", args.dtype]
    if args.async_scheduling is not None:  # else the engine's default
        flags.append(f"--{'' if args.async_scheduling else 'no-'}async-scheduling")
    flags += parallel_flags(args)
    return flags + (["--quantization", args.quantization] if args.quantization else [])


def run_serving(
    args: argparse.Namespace, model_dir: Path, runs: Path
) -> dict[int, dict]:
    serve_args = [
        "--load-format", "dummy",
        "--max-model-len", str(args.input_len + args.output_len),
        "--max-num-seqs", str(max(args.concurrency)),
        *engine_flags(args),
    ]  # fmt: skip
    results = {}
    log = args.output_dir / "server.log"
    with ServeProcess(model_dir, serve_args, log, startup_s=args.startup_s) as server:
        client = [sys.executable, str(HERE / "benchmark_serving.py")]
        client += ["--base-url", server.base_url, "--input-len", str(args.input_len)]
        client += ["--output-len", str(args.output_len), "--disable-tqdm"]
        # warm-up: the first requests' compilations. Every run draws its own
        # prompts (seed): none finds another's in the prefix cache
        warm_up_seed = str(max(args.concurrency) + 1)
        subprocess.run(
            [*client, "--num-prompts", "4", "--seed", warm_up_seed], check=True
        )
        for c in args.concurrency:
            path = runs / f"serving_c{c}.json"
            flags = ["--max-concurrency", str(c), "--result-json", str(path)]
            flags += ["--seed", str(c)]
            flags += ["--num-prompts", str(num_requests(args, c))]
            print("$", " ".join(client + flags), flush=True)
            subprocess.run(client + flags, check=True)
            results[c] = json.loads(path.read_text())["summary"]
        if server.stop() != 0:
            raise SystemExit(f"vllm serve exited badly; see {log}")
    return results


def run_offline(
    script: str, args: argparse.Namespace, flags: list[str], runs: Path
) -> dict:
    """One offline benchmark in a fresh process (the GPU to itself); its
    only row."""
    path = runs / f"{script}_{'_'.join(flags).replace('-', '')}.json"
    cmd = [sys.executable, str(HERE / f"{script}.py"), "--preset", args.preset]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += [*engine_flags(args), *flags, "--output-json", str(path)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return dict(json.loads(path.read_text())["rows"][0])


def plot(summaries: list[dict], path: Path) -> None:
    """Throughput and TPOT against concurrency, one line pair per sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for summary in summaries:
        rows, label = summary["rows"], summary["label"]
        c = [r["concurrency"] for r in rows]
        line = left.plot(c, [r["serving_output_tok_s"] for r in rows], "o-")[0]
        offline = [r["offline_output_tok_s"] for r in rows]
        left.plot(c, offline, "s--", color=line.get_color())
        line.set_label(f"{label}: serve (o) / offline (s)")
        line = right.plot(c, [r["serving_tpot_ms"] for r in rows], "o-")[0]
        line.set_label(f"{label}: serve (o) / engine batch 1 (s)")
        one = [r for r in rows if r["offline_tpot_ms"] is not None]
        engine = [r["offline_tpot_ms"] for r in one]
        right.plot([1] * len(one), engine, "s", color=line.get_color())
    left.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log")
    right.set(xlabel="concurrency", ylabel="TPOT median (ms)", xscale="log")
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
    fig.suptitle(summaries[0]["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    # At 2 waves the H200's serve/offline ratio at c = 256 moved 0.70 -> 1.11
    # between leases: how the prefills fall into steps varies that much.
    parser.add_argument("--waves", type=int, default=4, help="requests per slot")
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["fp8", "w4a16", "w4a8"])
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None
    )
    add_parallel_args(parser)
    parser.add_argument("--startup-s", type=float, default=600.0)
    parser.add_argument("--output-dir", type=Path, default=Path("out/serving_sweep"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--plot-from",
        type=Path,
        nargs="+",
        help="only plot these sweeps' sweep.json files together",
    )
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.plot_from:
        summaries = [json.loads(path.read_text()) for path in args.plot_from]
        plot(summaries, args.output_dir / "sweep.png")
        return
    if min(args.concurrency) < 1:
        parser.error(f"--concurrency: expected values >= 1, got {args.concurrency}")
    args.concurrency = sorted(set(args.concurrency))

    rows, offline_rows = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_preset_config(args.preset, Path(tmp))
        serving = run_serving(args, model_dir, Path(tmp))
        for c in args.concurrency:
            n = num_requests(args, c)
            flags = ["--num-prompts", str(n), "--max-num-seqs", str(c)]
            offline = run_offline("benchmark_throughput", args, flags, Path(tmp))
            offline_rows[c] = offline
            tpot = None
            if c == 1:
                flags = ["--num-iters", "2"]
                latency = run_offline("benchmark_latency", args, flags, Path(tmp))
                offline_rows[0] = latency  # 0: the batch-1 latency run
                tpot = latency["tpot_ms"]
            rows.append(
                SweepRow(
                    c,
                    n,
                    serving[c]["output_throughput"],
                    offline["output_tokens_per_s"],
                    serving[c]["tpot_ms"]["median"],
                    tpot,
                    serving[c]["ttft_ms"]["median"],
                )
            )

    label = args.quantization or args.dtype
    title = f"{args.preset}, {args.input_len} in / {args.output_len} out"
    print(f"\n{title} ({label})")
    print(
        f"{'conc':>5} {'reqs':>5} {'serve tok/s':>12} {'offline tok/s':>14} "
        f"{'ratio':>6} {'serve TPOT ms':>14} {'engine TPOT ms':>15} {'TTFT ms':>8}"
    )
    for r in rows:
        engine_tpot = "-" if r.offline_tpot_ms is None else f"{r.offline_tpot_ms:.2f}"
        print(
            f"{r.concurrency:>5} {r.requests:>5} {r.serving_output_tok_s:>12.1f} "
            f"{r.offline_output_tok_s:>14.1f} "
            f"{r.serving_output_tok_s / r.offline_output_tok_s:>6.2f} "
            f"{r.serving_tpot_ms:>14.2f} {engine_tpot:>15} {r.serving_ttft_ms:>8.1f}"
        )
    server_log = (args.output_dir / "server.log").read_text().splitlines()
    summary = {
        "title": title,
        "label": label,
        "rows": [asdict(r) for r in rows],
        # Every run's own numbers, and where the server's engine loop spent
        # its time (one file: the device returns few).
        "serving": serving,
        "offline": offline_rows,
        "engine_loop": [line for line in server_log if "engine loop:" in line],
    }
    (args.output_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plot:
        plot([summary], args.output_dir / "sweep.png")


if __name__ == "__main__":
    main()
