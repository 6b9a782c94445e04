"""Structure-aware fuzzers for every parser of user-supplied files (issue 14).

Bounded, fixed-seed run: tests/test_fuzz.py (part of the suite).
Long run: `python -m tests.fuzz --minutes N [--family NAME]` from the repository root;
prints the counts per family and every violation found (exit 1 if any)."""
