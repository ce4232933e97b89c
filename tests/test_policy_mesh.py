"""Every runnable compute policy under a data-parallel mesh (issue 36 item 3): the batch sharded over 4 CPU
devices and the weights replicated give the tokens, decode order, NFE and computed positions of the same run
without a mesh (Sparse-dLLM also with Fast-dLLM's dual cache and threshold decoding: its key scoring sits in a
`lax.cond` inside the cache's block call), and `experiments.generate --policy=... --mesh=...` runs. One subprocess for everything: it
fakes the devices with XLA_FLAGS, and a collective that never completes (XLA aborts the process after its
rendezvous timeout) fails this test alone. Its cost is one compiled sampler program per run (two per case:
alone and sharded), so the binary runs the policy whose program compiles fastest (dKV-Cache) and the prompt is
written out rather than drawn by a compiled `randint`."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4
PROMPT = [[196, 127, 40, 153, 168, 84], [38, 181, 106, 146, 8, 33], [74, 130, 198, 26, 81, 191],
          [3, 2, 160, 92, 96, 114]]
"""One prompt of 6 ids per device (`jax.random.randint(jax.random.key(1), (4, 6), 0, 200)`, the draw the runs
were checked with)."""
BINARY_POLICY = "dkv_cache:cache_reloading_step=3"
"""The policy `experiments.generate` runs with and without `--mesh` (its sampler program compiles in about half
the time of Sparse-dLLM's)."""
D2CACHE = "current_k=2,rollout_p=0.5"
"""d2Cache knobs under which its official batch coupling (`top_up`, on by default) changes the run: rows select
different counts, so a device that topped up its own row only would compute other positions."""
POLICIES = {"dkv_cache": "dkv_cache:cache_reloading_step=3", "sparse_dllm": "sparse_dllm:keep_ratio=0.5",
            "d2cache": f"d2cache:{D2CACHE}", "dllm_cache": "dllm_cache:prompt_interval_steps=3,gen_interval_steps=2",
            "elastic_cache": "elastic_cache:window_length=4", "sparsed": "sparsed:skip=0.2,select=0.3,block_size=3"}
"""Each runnable policy, with knobs that make its decisions change within the tiny run (reloads, reuse cases,
the sparse step)."""
BATCH_INVARIANT = ("dllm_cache",)
"""Policies also run with `batch_invariant=True` under the mesh (rows mapped one at a time; the batch is
replicated first, `dlm_jax.sampling.replicated_rows`): dLLM-Cache's four-case switch ended every such run in
XLA's rendezvous timeout before."""
CACHED = {"sparse_dllm": "sparse_dllm:keep_ratio=0.5"}
"""Policies also run with Fast-dLLM's dual cache and threshold decoding (Sparse-dLLM is the one that composes
with a cache)."""

_SCRIPT = r"""
import json, sys
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from dlm_jax.config import preset
from dlm_jax.model import init_params
from dlm_jax.policy.registry import parse_policy
from dlm_jax.runtime import sharding
from dlm_jax.sampling import llada
from experiments import generate
from experiments.common import cli
from absl import flags

policies, invariant, cached = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
prompt, binary_policy, out = np.asarray(json.loads(sys.argv[4]), np.int32), sys.argv[5], sys.argv[6]
devices = len(prompt)
config = preset("tiny-llada")
exact = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
dual = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4, threshold=0.9, cache="dual")
params = init_params(config, jax.random.key(0))
mesh = sharding.make_mesh(data=devices)
meshed = dict(params=sharding.put_host(params, sharding.replicated(mesh)), prompt=sharding.put_rows(prompt, mesh))
FIELDS = ("tokens", "decode_step", "nfe", "computed_positions")
cases = [(f"{name} batch_invariant={flag}", text, exact, flag) for name, text in policies.items()
         for flag in ((False, True) if name in invariant else (False,))]
cases += [(f"{name} dual cache", text, dual, False) for name, text in cached.items()]
results = {}
for case, text, options, batch_invariant in cases:
  run = dict(config=config, options=options, policy=parse_policy(text), batch_invariant=batch_invariant)
  alone = llada.generate(params, prompt, **run)
  sharded = llada.generate(meshed["params"], meshed["prompt"], **run)
  if case.startswith("d2cache"):
    alone_d2cache = alone
  results[case] = {
      "sharding": str(sharded.tokens.sharding.spec),
      "same": {f: bool(np.array_equal(np.asarray(getattr(alone, f)), np.asarray(getattr(sharded, f))))
               for f in FIELDS},
      "computed": int(np.asarray(sharded.computed_positions).sum()),
      "every": int(np.asarray(sharded.computed_positions).size)}
uncoupled = llada.generate(params, prompt, config=config, options=exact,
                           policy=parse_policy(policies["d2cache"] + ",top_up=false"))
results["top_up changes the run"] = not np.array_equal(np.asarray(uncoupled.computed_positions),
                                                       np.asarray(alone_d2cache.computed_positions))
binary = {}
for mesh_flag in ("", f"data:{devices}"):
  json_out = f"{out}/generate-{mesh_flag or 'none'}.json"
  flags.FLAGS.unparse_flags()
  cli.call(generate.main, flags.FLAGS(["generate", "--checkpoint=tiny-dlm", "--prompt_ids=1,63,76,13,65,51",
                                       "--gen_length=8", "--steps=8", "--block_length=4",
                                       f"--policy={binary_policy}",
                                       f"--mesh={mesh_flag}", f"--json_out={json_out}"]))
  with open(json_out) as f:
    binary[mesh_flag or "none"] = json.load(f)
results["generate"] = {k: binary["none"][k] == binary[f"data:{devices}"][k] for k in ("tokens", "decode_step", "nfe")}
print(json.dumps(results))
"""


def test_every_policy_gives_the_same_run_under_a_data_mesh(tmp_path):
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(POLICIES), json.dumps(BATCH_INVARIANT),
                         json.dumps(CACHED), json.dumps(PROMPT), BINARY_POLICY, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=900, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  expected = {f"{name} batch_invariant={flag}" for name in POLICIES for flag in
              ((False, True) if name in BATCH_INVARIANT else (False,))}
  expected |= {f"{name} dual cache" for name in CACHED}
  assert expected <= set(results)
  for case in expected:
    replicated = case.endswith("batch_invariant=True")  # replicated_rows; else the batch really was sharded
    assert results[case]["sharding"] == ("P()" if replicated else "P('data',)"), case
    assert all(results[case]["same"].values()), (case, results[case])
    if not case.startswith(("dllm_cache", "sparsed")):  # these two compute every position (and skip within)
      assert results[case]["computed"] < results[case]["every"], case  # the policy skipped work under the mesh
  assert results["top_up changes the run"]  # so d2cache's equality above shows top_up read the whole batch
  assert all(results["generate"].values()), results["generate"]
