"""The fuzz families (tests/fuzz) in a fixed-seed, bounded run: a few dozen inputs per
family, the same inputs every run.  The long run is `python -m tests.fuzz --minutes N`;
`--family "k3 end to end"` runs damaged models through the real process (about a second an
input, so not part of the suite)."""
from __future__ import annotations

import collections

import pytest

pytest.importorskip("hypothesis", reason="hypothesis (the test extra) is not installed")
pytest.importorskip("safetensors", reason="safetensors (a core dependency) is not installed")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from fuzz.families import FAMILIES  # noqa: E402

EXAMPLES = 60


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_fuzz_family_fixed_seed(fam):
    counts: collections.Counter = collections.Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(fam.strategy)
    def run(x):
        counts[fam.check(x)] += 1

    run()
    print(f"[gate] fuzz {fam.name}: {sum(counts.values())} inputs, "
          + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    assert sum(counts.values()) >= EXAMPLES // 2
    # a family that only ever refuses (or only accepts) is not exercising the parser
    assert len(counts) >= 2, counts

