"""Activation hooks under a compute policy (`dlm_jax.policy`): what captures and edits mean when a call computes
part of the sequence, and the combinations refused.

Every call of the run carries the hooks (`dlm_jax.sampling.policy_call`). Captures stay in sequence coordinates
[B, S, ...]: the positions a call computed carry that call's activations, every other position holds zeros (the
value the position had when last computed is in the capture of that earlier call). `Trace.computed_positions`
[steps, B, S] says which positions each step computed — mask with it — and `Trace.computed_queries` gives their
span. Per call kind:

  * full call: every position, as without a policy;
  * query subset (dkv_cache, sparse_dllm, d2cache): the decided positions; their keys and values at every
    layer read the other positions' cached keys and values (`attn.hook_pattern` is over the keys the query read:
    a key subset's kept keys and the queries, zeros at the keys dropped);
  * key blocks (sparsed): every position; `attn.hook_pattern` is the block-sparse attention (zeros at the
    dropped key blocks).

Edits act where the call computes: at a subset call, the decided positions only — an edit aimed at a position
the call does not compute changes nothing at that call (the position's cached keys and values are those of the
call that last computed it, with the edits of that call). A "mean" reduction or a "mean" edit averages over
the positions the call computed.
"""

from __future__ import annotations

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.hook_spec import Hooks

UNHOOKED = {
    "dllm_cache": "its calls reuse each layer's attention and feed-forward outputs at positions chosen inside the "
                  "forward",
}
"""The policies whose calls do not run hooks, and why."""


def check(name: str, hooks: Hooks, config: ModelConfig) -> None:
  """Raises ValueError (one line) when hooks cannot run under the policy named `name`."""
  del config
  if hooks.enabled and name in UNHOOKED:
    raise ValueError(f"policy {name!r} does not run with activation hooks ({UNHOOKED[name]}); leave the hooks off "
                     f"or use a policy whose calls compute query or key subsets "
                     f"(dkv_cache, sparse_dllm, d2cache, sparsed).")
