"""``bench --draft KIND``: what speculative decoding buys, per prompt set, against plain decoding.

Each prompt of each set (``engine/bench/data/speculative_prompts.json``: code edits, whose replies
repeat their prompt, and plain chat) is answered greedily, one job at a time, with and without
the drafter, alternating the two per prompt and repeat so that both see the same machine load.
Reported per set: decode tokens/s either way (the Generator's own timings: tokens after the
first over the time they took) and their ratio, the worst single prompt's ratio, the drafts'
acceptance rate, accepted tokens per verify step and tokens per decode step, and whether the
drafted replies equal the plain ones. Figures are medians over ``--repeats`` after a warm-up.

Greedy, the replies must be equal, with one exception that is not the drafter's: a verify step
computes 1 + k rows where plain decoding computes one, and a half-precision model (or the CPU's
int8 path, which rounds activations and logits to bfloat16) may round them differently, so the
two can part where the target's two best tokens are all but tied. Where replies part, the bench
scores the plain reply up to that point and reports the two tokens' logit margin: within
:data:`TIE_MARGIN` of the top logit's magnitude it is a near-tie (``tie``), wider a bug (``NO``,
exit status 1).

Beside them, the copy bound: tokens per decode step that prompt lookup would reach on the plain
replies if every draft were the best earlier run of the sequence (:func:`copy_bound_steps`).
It says how much of a model's replies is a copy at all, which no n-gram drafter can exceed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.json"
# Logit margin, relative to the top logit's magnitude, below which two tokens count as tied: a
# few bfloat16 steps (one is at most 1/128 relative), what a differently rounded step can flip.
TIE_MARGIN = 0.02


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _reply(session, ids: list[int], new_tokens: int, settings) -> dict[str, Any]:
    """One reply: its tokens, decode speed, and decode steps taken."""
    from engine.generation.job import Job

    gen = session.generator
    job = Job(ids, new_tokens, settings)
    tokens: list[int] = []
    steps = 0
    last = None
    for result in gen.stream(job):
        tokens += result.token_ids
        steps += 1
        last = result
    decode_s = last.timings.decode_s if last else 0.0
    return {
        "tokens": tokens,
        "tokens_per_s": last.timings.tokens_per_second(last.new_tokens) if last else 0.0,
        "decode_s": decode_s,
        "decode_steps": max(1, steps - 1),  # the first token comes from the prefill step
    }


def copy_bound_steps(context: list[int], reply: list[int], max_tokens: int) -> int:
    """Decode steps that produce ``reply`` after ``context`` when each step's draft is the best
    possible copy: the longest run of the sequence so far (at most ``max_tokens``; a run that
    reaches the sequence's end goes on from its own start, as n-gram drafts do) that equals the
    reply's next tokens, all of it kept, then the step's own token. A prompt-lookup drafter
    chooses its run from the tokens before it and cannot know which one the model will copy, so
    it needs at least this many steps."""
    seq = list(context)
    where: dict[int, list[int]] = {}  # token -> its positions in seq
    for position, token in enumerate(seq):
        where.setdefault(token, []).append(position)
    i = steps = 0
    while i < len(reply):
        best = 0
        for start in where.get(reply[i], ()):
            run = 1
            while run < max_tokens and i + run < len(reply):
                at = start + run  # past the end: the draft's own earlier tokens (matched so far)
                if (seq[at] if at < len(seq) else reply[i + at - len(seq)]) != reply[i + run]:
                    break
                run += 1
            best = max(best, run)
            if best == max_tokens:
                break
        for token in reply[i : i + best + 1]:
            where.setdefault(token, []).append(len(seq))
            seq.append(token)
        i += best + 1
        steps += 1
    return steps


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (one ending early counts); None if equal."""
    from engine.generation.speculative.drafter import common_prefix

    shared = common_prefix(a, b)
    return None if shared == len(a) == len(b) else shared


def parting(session, prompt: list[int], plain: list[int], drafted: list[int]) -> dict[str, Any] | None:
    """Where a drafted reply parts from the plain one, and the plain model's logit margin there
    between the two tokens (relative to the top logit's magnitude); None if they are equal."""
    from engine.generation.step import score_tokens

    at = first_difference(plain, drafted)
    if at is None:
        return None
    if at >= min(len(plain), len(drafted)):  # one stopped where the other went on: no two tokens
        return {"at": at, "margin": None, "tie": False}
    cache = session.generator.cache
    cache.pages.clear_cached()
    logits = score_tokens(session.model.module, cache, prompt + plain[:at])[-1].float()
    margin = abs(float(logits[plain[at]] - logits[drafted[at]])) / max(float(logits.abs().max()), 1e-9)
    return {"at": at, "margin": margin, "tie": margin <= TIE_MARGIN}


def _stats_delta(spec, before) -> dict[str, int]:
    s = spec.stats
    return {
        "verify_steps": s.verify_steps - before[0],
        "drafted": s.drafted - before[1],
        "accepted": s.accepted - before[2],
    }


def run_draft_bench(args) -> int:
    """The comparison for ``-m DIR`` with ``--draft``; prints a table, writes JSON with ``--json``."""
    from engine.session import ChatSession

    sets = json.loads(PROMPTS.read_text(encoding="utf-8"))
    names = [n for n in sets if n != "about"]
    options = replace(args.options, draft="off")
    plain = ChatSession.load(args.model, device=args.device, dtype=args.dtype, options=options)
    drafted = ChatSession(
        plain.model,
        plain.tokenizer,
        cache_tokens=None,
        options=replace(args.options, draft=args.draft, draft_tokens=args.draft_tokens or 4),
    )
    spec = drafted.generator.speculation
    new_tokens = args.decode_tokens
    sampling = _sampling(args)
    rows = []
    for name in names:
        prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in sets[name]]
        runs: dict[str, list[list[dict]]] = {"plain": [[] for _ in prompts], "draft": [[] for _ in prompts]}
        totals = {"verify_steps": 0, "drafted": 0, "accepted": 0}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for i, ids in enumerate(prompts):
                order = (("plain", plain), ("draft", drafted))
                for label, session in order if (repeat + i) % 2 == 0 else order[::-1]:
                    before = (spec.stats.verify_steps, spec.stats.drafted, spec.stats.accepted)
                    session.generator.cache.pages.clear_cached()  # no prefix reuse across runs
                    reply = _reply(session, ids, new_tokens, sampling)
                    if repeat > 0:
                        runs[label][i].append(reply)
                        if label == "draft":
                            for key, value in _stats_delta(spec, before).items():
                                totals[key] += value
            _log(f"  {name}: round {repeat + 1}/{args.repeats + 1} done")
        partings = (  # sampled replies differ by design: only greedy ones are compared
            [
                parting(plain, ids, p[0]["tokens"], d[0]["tokens"])
                for ids, p, d in zip(prompts, runs["plain"], runs["draft"])
            ]
            if sampling.is_greedy
            else None
        )
        rows.append(_row(name, runs, totals, args.repeats, prompts, spec.max_tokens, partings))
    result = {
        "model": str(args.model),
        "sampling": "app balanced (seeded)" if getattr(args, "sampled", False) else "greedy",
        "draft": args.draft,
        "draft_tokens": spec.max_tokens,
        "new_tokens": new_tokens,
        "repeats": args.repeats,
        "threads": __import__("torch").get_num_threads(),
        "sets": rows,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(format_table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2), encoding="utf-8")
    greedy = result["sampling"] == "greedy"
    return 0 if not greedy or all(r["same_tokens"] != "no" for r in rows) else 1


def _sampling(args):
    """Greedy, or with ``--sampled`` the app's default preset with a fixed seed (each reply is
    then the same in every round, drafted or not within itself; the two differ, so only their
    speeds compare)."""
    from engine.generation.sampling import SamplingSettings

    if not getattr(args, "sampled", False):
        return SamplingSettings.greedy()
    from engine.bench.sampler import PRESETS

    return SamplingSettings(**PRESETS["app balanced"], seed=0)


def _row(
    name: str,
    runs: dict,
    totals: dict,
    repeats: int,
    prompts: list[list[int]],
    draft_tokens: int,
    partings: list[dict | None] | None = None,
) -> dict[str, Any]:
    """One prompt set's figures: per prompt the median decode time of each mode, summed.
    ``partings``: per prompt, where its greedy drafted reply parted from the plain one
    (:func:`parting`); None for sampled replies, which are not compared."""

    def speed(label: str) -> float:
        tokens = time_s = 0.0
        for replies in runs[label]:
            median_s = statistics.median(r["decode_s"] for r in replies)
            tokens += len(replies[0]["tokens"]) - 1
            time_s += median_s
        return tokens / time_s if time_s else 0.0

    def rate(replies: list[dict]) -> float:
        return (len(replies[0]["tokens"]) - 1) / max(statistics.median(r["decode_s"] for r in replies), 1e-9)

    plain_tps, draft_tps = speed("plain"), speed("draft")
    # Each prompt's own ratio (decode tokens/s drafted over plain, medians): the worst one says
    # whether drafting ever costs more than it gives.
    per_prompt = [rate(d) / rate(p) for p, d in zip(runs["plain"], runs["draft"]) if rate(p) > 0]
    differences = [dict(part, prompt=i) for i, part in enumerate(partings or []) if part is not None]
    if partings is None:
        same = None
    else:
        same = "yes" if not differences else "tie" if all(d["tie"] for d in differences) else "no"
    steps = sum(r["decode_steps"] for replies in runs["draft"] for r in replies)
    tokens = sum(len(r["tokens"]) - 1 for replies in runs["draft"] for r in replies)
    # The first token comes from the prefill: the bound, like tok/step, counts the ones after it.
    plain_replies = [replies[0]["tokens"] for replies in runs["plain"]]
    bound_steps = sum(
        copy_bound_steps(p + r[:1], r[1:], draft_tokens) for p, r in zip(prompts, plain_replies)
    )
    return {
        "set": name,
        "prompts": len(runs["plain"]),
        "plain_tokens_per_s": plain_tps,
        "draft_tokens_per_s": draft_tps,
        "speedup": draft_tps / plain_tps if plain_tps else 0.0,
        "speedup_per_prompt": per_prompt,
        "worst_speedup": min(per_prompt, default=None),  # None: no reply went past its first token
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "accepted_per_verify_step": totals["accepted"] / totals["verify_steps"]
        if totals["verify_steps"]
        else 0.0,
        "tokens_per_decode_step": tokens / steps if steps else 0.0,
        "copy_bound_tokens_per_step": sum(len(r) - 1 for r in plain_replies) / bound_steps
        if bound_steps
        else 0.0,
        "drafted": totals["drafted"],
        "accepted": totals["accepted"],
        "same_tokens": same,
        "differences": differences,
    }


def format_table(r: dict) -> str:
    lines = [
        f"speculative decoding: {r['draft']} (at most {r['draft_tokens']} tokens), "
        f"{r['new_tokens']} new tokens per reply, {r['sampling']}, batch 1, median of {r['repeats']}, "
        f"{r['threads']} threads",
        f"{'set':<10} {'plain tok/s':>11} {'draft tok/s':>11} {'ratio':>6} {'accepted':>9} "
        f"{'acc/verify':>10} {'tok/step':>8} {'bound':>6} {'worst':>6} {'same':>5}",
    ]
    for row in r["sets"]:
        lines.append(
            f"{row['set']:<10} {row['plain_tokens_per_s']:>11.1f} {row['draft_tokens_per_s']:>11.1f} "
            f"{row['speedup']:>5.2f}x {row['acceptance_rate']:>8.0%} "
            f"{row['accepted_per_verify_step']:>10.2f} "
            f"{row['tokens_per_decode_step']:>8.2f} {row['copy_bound_tokens_per_step']:>6.2f} "
            f"{_ratio(row['worst_speedup']):>6} "
            f"{_same_label(row['same_tokens']):>5}"
        )
    return "\n".join(lines)


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _same_label(same: str | None) -> str:
    return {None: "-", "no": "NO"}.get(same, same)
