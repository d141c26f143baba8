"""``python -m engine search TEXT [--exl3] [--json]``: search models on the Hugging Face Hub.

``--supported`` keeps only architectures the engine runs; ``--min-params/--max-params`` take
counts like ``500M`` or ``8B``. Honours ``HF_ENDPOINT`` and ``HF_TOKEN``.
"""

from __future__ import annotations

import argparse
import json

from engine.commands.common import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("search", help="search models on the Hugging Face Hub", description=__doc__)
    p.add_argument("text", nargs="?", default="", help="words the model id must contain")
    p.add_argument("--exl3", action="store_true", help="only EXL3-quantized models")
    p.add_argument("--supported", action="store_true", help="only architectures the engine supports")
    p.add_argument("--min-params", default=None, help="e.g. 1B")
    p.add_argument("--max-params", default=None, help="e.g. 8B")
    p.add_argument(
        "--sort", default="downloads", choices=["downloads", "likes", "updated", "created", "trending"]
    )
    p.add_argument("--limit", type=positive_int, default=20, help="most models to list (default 20)")
    p.add_argument("--json", action="store_true", help="print JSON (one array) instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so the CLI starts without the Hub stack (see commands/download.py).
    from engine.hub.client import HubClient, SearchQuery
    from engine.hub.errors import HubError
    from engine.units import format_count, parse_count

    try:
        lo = parse_count(args.min_params) if args.min_params else None
        hi = parse_count(args.max_params) if args.max_params else None
    except ValueError as exc:
        raise HubError(str(exc)) from None
    query = SearchQuery(
        text=args.text,
        exl3=args.exl3,
        supported_only=args.supported,
        min_params=lo,
        max_params=hi,
        sort=args.sort,
        limit=args.limit,
    )
    hits = HubClient().search(query)
    if args.json:
        print(json.dumps([h.to_json() for h in hits], indent=1))
        return 0
    if not hits:
        print("no models found")
        return 0
    width = max(len(h.repo_id) for h in hits)
    print(f"{'model':<{width}}  {'params':>7}  {'downloads':>10}  {'likes':>6}  {'updated':<10}  notes")
    for h in hits:
        notes = ", ".join(
            n for n, on in (("exl3", h.exl3), ("supported", h.supported), ("gated", bool(h.gated))) if on
        )
        params = format_count(h.params)
        updated = h.last_modified.date().isoformat() if h.last_modified else ""
        print(f"{h.repo_id:<{width}}  {params:>7}  {h.downloads:>10}  {h.likes:>6}  {updated:<10}  {notes}")
    return 0
