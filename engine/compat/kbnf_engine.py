"""Build kbnf 0.4.2 engines (formatron's grammar engine) with their token-mask cache off.

Why this exists
---------------
kbnf remembers each token mask it computes, keyed by the parser's Earley sets alone
(``EngineBase::compute_allowed_token_ids``: ``cache: AHashMap<EarleySets, FixedBitSet>``). The
Leo and post-dot items, which also decide what may follow, are not part of the key, so after
compaction a later state can be served an earlier state's mask. Which states collide depends
on the order of the items in a set, and that follows ahash's per-process random seeds: the same
token sequence gets a wrong mask in some processes and not in others. Seen here with the
"5 refs+unions" schema of ``constrain-eval`` (``subtasks`` has ``maxItems: 2``): after the
second subtask's ``"done":true`` the mask allowed ``},`` (a third subtask) in 4 of 6 processes;
the uncached mask never did.

A wrong mask then meets a second kbnf bug: a multi-byte token whose first byte is accepted
(and compacts the Earley sets) but whose next byte is rejected makes ``revert_change`` panic
("slice index starts at 9 but ends at 7", a ``pyo3_runtime.PanicException``) instead of raising
the usual "rejected" ValueError. Together: 15 of 30 replays of one sampled SmolLM2 run panicked
with the cache on, 0 of 16 with it off.

What it costs: nothing measurable. On SmolLM2's 49k-token vocabulary the mask took 0.15 ms a
token with the cache and 0.15 ms without it (schema 5), 0.16 and 0.12 ms (a recipe schema):
storing a copy of the Earley sets and the mask at every step costs about what the hits save,
and a job's engine copies (which carry the cache) get cheaper.

When to delete it
-----------------
When kbnf keys its cache by the whole parser state. The second bug has a deterministic
reproduction in ``tests/engine/test_constraints.py``
(``test_kbnf_still_panics_on_a_token_rejected_after_compaction``); the generator ends a job
whose engine panics with a clear error either way.
"""

from __future__ import annotations

from typing import Any


def engine_config() -> Any:
    """A ``kbnf.Config`` with kbnf's defaults except the token-mask cache, which is off."""
    import kbnf

    config = kbnf.Config()
    engine = config.engine_config  # a copy: pyo3 hands out values, so set it back afterwards
    engine.cache_enabled = False
    config.engine_config = engine
    return config
