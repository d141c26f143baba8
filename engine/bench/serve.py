"""``python -m engine bench-serve``: throughput of the OpenAI-compatible server against the engine
called directly, in the same run, on the same loaded model.

At each concurrency C, C clients each send their next request as soon as their last one is
answered, until all requests are done (a closed loop, as chat users or an agent's workers do).
*engine* keeps C jobs in the Generator directly; *http* sends the same requests (the same
prompts, greedy, the same budget) to ``serve``'s app through the ``openai`` client, streamed as
chat clients read them, from C threads. Both report requests per second, aggregate generated
tokens per second (counted by the engine, usage for http) and mean latency; the ratio http/engine
is what the HTTP layer (JSON, SSE, the event loop, the hop to the engine's thread) costs.

Every request runs once untimed first on both paths, so both start from the same warm prefix
cache and neither pays for first-call allocations.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from engine.bench import help_for
from engine.commands.common import add_model_args, positive_int, run_alone

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about a trip to the sea.",
    "Explain why the sky is blue.",
    "Tell the story of a robot that learns to paint.",
    "Describe your favourite city and why you like it.",
    "Write a recipe for vegetable soup, step by step.",
]


def register(sub) -> None:
    p = sub.add_parser("bench-serve", help=help_for("bench-serve"))
    add_model_args(p, required=False)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default 1,4,16)")
    p.add_argument(
        "--requests", type=positive_int, default=None, help="requests per level (default 2 x C, >= 8)"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=64, help="reply budget per request (default 64)"
    )
    p.add_argument("--no-stream", action="store_true", help="http: whole replies instead of SSE streams")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.set_defaults(func=run)


def _levels(text: str) -> list[int]:
    from engine.errors import UsageError

    try:
        levels = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--concurrency must be comma-separated whole numbers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency must be whole numbers >= 1, got {text!r}")
    return levels


def _requests(level: int, count: int | None) -> list[list[dict]]:
    n = count or max(8, 2 * level)
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]


def run_engine(session, requests: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    """The requests through the Generator, ``concurrency`` jobs in flight at a time."""
    from engine.generation.job import Job
    from engine.generation.sampling import SamplingSettings

    gen, tok = session.generator, session.tokenizer
    waiting = deque(requests)
    started: dict = {}
    latencies, tokens = [], 0
    t0 = time.perf_counter()

    def launch() -> None:
        job = Job(
            tok.encode_chat(waiting.popleft(), add_generation_prompt=True),
            max_tokens,
            SamplingSettings.greedy(),
        )
        started[job] = time.perf_counter()
        gen.enqueue(job)

    for _ in range(min(concurrency, len(waiting))):
        launch()
    while started:
        for result in gen.iterate():
            if result.done:
                latencies.append(time.perf_counter() - started.pop(result.job))
                tokens += result.new_tokens
                if waiting:
                    launch()
    return _row("engine", concurrency, len(requests), tokens, time.perf_counter() - t0, latencies)


def run_http(
    client, model: str, requests: list[list[dict]], concurrency: int, max_tokens: int, stream: bool
) -> dict:
    def one(messages: list[dict]) -> tuple[float, int]:
        start = time.perf_counter()
        kwargs = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
        if stream:
            usage = None
            for chunk in client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            ):
                usage = chunk.usage or usage
            tokens = usage.completion_tokens
        else:
            tokens = client.chat.completions.create(**kwargs).usage.completion_tokens
        return time.perf_counter() - start, tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, requests))
    elapsed = time.perf_counter() - t0
    return _row("http", concurrency, len(requests), sum(t for _, t in done), elapsed, [s for s, _ in done])


def _row(
    path: str, concurrency: int, requests: int, tokens: int, seconds: float, latencies: list[float]
) -> dict:
    return {
        "path": path,
        "concurrency": concurrency,
        "requests": requests,
        "tokens": tokens,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "tokens_per_s": tokens / seconds,
        "mean_latency_s": sum(latencies) / len(latencies),
    }


def _print(row: dict, base: dict | None) -> None:
    ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
    print(
        f"{row['concurrency']:>4} {row['path']:<7} {row['requests']:>5} {row['tokens']:>7} "
        f"{row['requests_per_s']:>7.2f} {row['tokens_per_s']:>8.1f} {row['mean_latency_s']:>9.2f} {ratio:>6}",
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    import openai

    from engine.serve.runner import BackgroundServer
    from engine.serve.server import OpenAIServer, ServeOptions
    from engine.session import ChatSession

    levels = _levels(args.concurrency)
    model_dir = args.model
    if model_dir is None:  # the starter model, imported once into a temporary folder
        import tempfile
        from pathlib import Path

        from engine.starter import ensure_starter_model

        model_dir = ensure_starter_model(Path(tempfile.mkdtemp(prefix="bench-serve-")))
    # Room for the largest level's jobs at once (each reserves its whole budget), prompts included.
    cache_tokens = max(4096, max(levels) * (args.max_tokens + 128))
    session = ChatSession.load(
        model_dir, device=args.device, dtype=args.dtype, cache_tokens=cache_tokens, options=args.options
    )
    print(
        f"bench-serve: {session.model_name} on {session.device}, greedy, {args.max_tokens} tokens per reply, "
        f"http {'whole replies' if args.no_stream else 'streamed (SSE)'}"
    )
    plans = {level: _requests(level, args.requests) for level in levels}
    warm = _requests(1, len(PROMPTS))
    rows = []
    server = OpenAIServer(session, ServeOptions())
    with BackgroundServer(server) as bg:
        client = openai.OpenAI(base_url=bg.base_url, api_key="bench", max_retries=0, timeout=3600)
        run_engine(session, warm, len(PROMPTS), args.max_tokens)
        run_http(client, server.model_name, warm, len(PROMPTS), args.max_tokens, True)
        header = ("C", "path", "reqs", "tokens", "req/s", "tok/s", "latency s", "ratio")
        print("{:>4} {:<7} {:>5} {:>7} {:>7} {:>8} {:>9} {:>6}".format(*header))
        for level in levels:
            # Side by side per level, so both see the same machine. The server's engine loop
            # touches the Generator only while it has requests, so the direct run has it alone.
            base = run_engine(session, plans[level], level, args.max_tokens)
            row = run_http(
                client, server.model_name, plans[level], level, args.max_tokens, not args.no_stream
            )
            _print(base, None)
            _print(row, base)
            rows += [base, row]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": session.model_name, "device": session.device, "rows": rows}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "bench-serve", argv)


if __name__ == "__main__":
    sys.exit(main())
