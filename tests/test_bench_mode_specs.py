"""`benchmarks.decoding_modes_bench --modes`: a decoding rule with several knobs in one comma-separated item ("+"
between its knobs), read by `decoding_mode.from_spec` as the comma form; parse level only (the benchmark itself runs
in tests/test_experiments_decoding_modes.py; its module is not imported here, its flags would clash with the
binaries' in one test process)."""

import pytest
from absl import flags

from dlm_jax.sampling import corpus_prior
from dlm_jax.session import SessionError, decoding_mode


def test_a_rule_with_two_knobs_is_one_mode_item(tmp_path):
  prior = str(tmp_path / "a+b.json")
  corpus_prior.save(corpus_prior.count([[4, 5]], {f"t{i}": i for i in range(8)}), prior)
  items = flags.ListParser().parse(f"exact,eb:gamma=0.01+cache=dual,threshold:0.9,pc:prior={prior}+lam=0.5")
  assert items == ["exact", "eb:gamma=0.01+cache=dual", "threshold:0.9", f"pc:prior={prior}+lam=0.5"]
  modes = [decoding_mode.from_spec(item) for item in items]
  assert modes[1] == decoding_mode.from_spec("eb:gamma=0.01,cache=dual")
  assert modes[1].record() == {"decoding": "eb", "knobs": {"gamma": 0.01}, "cache": "dual"}
  assert modes[2].threshold == 0.9
  assert dict(modes[3].knobs) == {"prior": prior, "lam": 0.5}  # a "+" not before `knob=` stays in the value
  assert dict(decoding_mode.from_spec("eb:gamma=1e+2").knobs) == {"gamma": 100.0}
  assert decoding_mode.from_spec("factor:1e+2").factor == 100.0
  with pytest.raises(SessionError, match="decoding rule eb has no knob sigma") as info:
    decoding_mode.from_spec("eb:gamma=0.1+sigma=2")
  assert "\n" not in str(info.value)
