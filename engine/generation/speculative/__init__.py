"""Speculative decoding: drafters guess tokens, the target verifies them in one step.

``drafter`` (the interface), ``ngram`` / ``draft_model`` / ``mtp`` (the drafters), ``draft_length``
(how many to guess), ``acceptance`` (which guesses are kept), ``speculation`` (inside the
Generator's steps: verify items, acceptance, rollback), ``factory`` (from ``--draft`` to a
drafter). docs/SPECULATIVE.md has the design and the measured figures.
"""
