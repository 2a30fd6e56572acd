"""Online serving benchmark: an async client against any OpenAI-compatible
``/v1/completions`` endpoint (``vllm serve`` or another server).

The client is aiohttp, as vLLM's: it parses a streamed event in ~70 us of
CPU where httpx took ~350 us, which capped an httpx client at ~3,000
events/s, below a loaded server's rate (the H200 at 256 streams).

Prompts are random token ids (ids below ``--token-id-high``: every
vocabulary has them), of ``--input-len`` tokens, or lengths drawn uniformly
within ``--range-ratio`` of it; every request streams exactly
``--output-len`` tokens (``ignore_eos``, as vLLM's benchmarks). Requests
arrive as a Poisson process of ``--request-rate`` per second (``inf``: all
at once), at most ``--max-concurrency`` in flight. Per request it records
the time to the first streamed event (TTFT), the gaps between events (ITL;
a server may pack several tokens into one) and the time per output token
after the first (TPOT); then prints request and token throughput with the
mean, median and p99 of each, and writes them and every request to
``--result-json``. A server without a tokenizer (dummy weights from a bare
``config.json``) serves these token-id prompts as well.

    vllm serve /path/to/checkpoint --port 8000 &
    python benchmarks/benchmark_serving.py --num-prompts 512 \\
        --input-len 1024 --output-len 256 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # tokens the server reported generating
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class Summary:
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float  # finished requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # prompt + output tokens per second
    ttft_ms: dict[str, float]  # mean, median, p99
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]


def percentiles_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "mean": statistics.fmean(ordered) * 1e3,
        "median": statistics.median(ordered) * 1e3,
        "p99": p99 * 1e3,
    }


def sample_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    low = max(1, round(args.input_len * (1 - args.range_ratio)))
    high = max(low, round(args.input_len * (1 + args.range_ratio)))
    return [
        [rng.randrange(args.token_id_high) for _ in range(rng.randint(low, high))]
        for _ in range(args.num_prompts)
    ]


async def send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    temperature: float,
) -> RequestResult:
    """One streamed completion; errors are recorded, not raised."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {await response.text()!r}"
                return result
            async for raw in response.content:  # one line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue  # the usage event
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except (aiohttp.ClientError, ValueError) as e:  # ValueError: an oversized line
        result.error = repr(e)
    result.latency_s = time.perf_counter() - start
    return result


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def run_benchmark(
    args: argparse.Namespace,
) -> tuple[Summary, list[RequestResult]]:
    prompts = sample_prompts(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(limit=0),  # no cap: the semaphore limits
        timeout=aiohttp.ClientTimeout(total=None),
        read_bufsize=2**20,  # room for long events (log-probs)
    ) as session:
        model = args.model or await first_model(session, args.base_url)
        url = f"{args.base_url}{args.endpoint}"
        concurrency = asyncio.Semaphore(args.max_concurrency or len(prompts))
        progress = tqdm(total=len(prompts), disable=args.disable_tqdm)

        async def one(index: int) -> RequestResult:
            async with concurrency:
                result = await send(
                    session, url, model, prompts[index], args.output_len,
                    args.temperature,
                )  # fmt: skip
            progress.update()
            return result

        arrivals = random.Random(args.seed + 1)
        start = time.perf_counter()
        tasks = []
        for index in range(len(prompts)):
            tasks.append(asyncio.create_task(one(index)))
            if args.request_rate != float("inf"):  # Poisson: exponential gaps
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        progress.close()
    return summarize(results, duration), results


def summarize(results: list[RequestResult], duration_s: float) -> Summary:
    done = [r for r in results if r.error is None]
    output = sum(r.output_len for r in done)
    prompt = sum(r.prompt_len for r in done)
    tpots = [
        (r.latency_s - r.ttft_s) / (r.output_len - 1) for r in done if r.output_len > 1
    ]
    return Summary(
        num_requests=len(results),
        num_failed=len(results) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        output_throughput=output / duration_s,
        total_token_throughput=(prompt + output) / duration_s,
        ttft_ms=percentiles_ms([r.ttft_s for r in done]),
        tpot_ms=percentiles_ms(tpots),
        itl_ms=percentiles_ms([gap for r in done for gap in r.itl_s]),
    )


def format_table(summary: Summary) -> str:
    rows = [
        ("Successful requests", f"{summary.num_requests - summary.num_failed}"),
        ("Failed requests", f"{summary.num_failed}"),
        ("Benchmark duration (s)", f"{summary.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{summary.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{summary.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{summary.total_token_throughput:.2f}"),
    ]
    for name, stats in (
        ("TTFT", summary.ttft_ms),
        ("TPOT", summary.tpot_ms),
        ("ITL", summary.itl_ms),
    ):
        rows += [
            (f"{stat.capitalize()} {name} (ms)", f"{stats[stat]:.2f}") for stat in stats
        ]
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{name:<{width}}{value:>12}" for name, value in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="default: the first served")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="prompt lengths uniform in input-len * [1 - r, 1 + r] (0: fixed)",
    )
    parser.add_argument("--token-id-high", type=int, default=256)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson, req/s"
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (the default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--disable-tqdm", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.range_ratio < 1:
        parser.error(f"--range-ratio: expected in [0, 1), got {args.range_ratio}")
    return args


def main(argv: list[str] | None = None) -> Summary:
    args = parse_args(argv)
    summary, results = asyncio.run(run_benchmark(args))
    print(format_table(summary))
    if args.result_json is not None:
        payload = {
            "config": {k: str(v) for k, v in vars(args).items()},
            "summary": asdict(summary),
            "requests": [asdict(r) for r in results],
        }
        args.result_json.write_text(json.dumps(payload, indent=2))
    return summary


if __name__ == "__main__":
    main()
