"""An independent NumPy forward of a dense bidirectional model (tiny-llada's architecture: pre-norm RMSNorm,
q/k/v/o without bias — q/k/v with the bias where the parameters have one, tiny-dream's Qwen2 layout —,
rotate-half RoPE over the whole head, softmax attention, SwiGLU), returning every
named site, with optional edits written here from scratch. The reference the activation-hook tests compare
against; it shares no code with dlm_jax.model."""

from __future__ import annotations

import numpy as np


def _rms(x, weight, eps):
  x = x.astype(np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x, positions, theta):
  """x [B, T, N, H] rotated at integer positions [T] (rotate-half pairs j, j + H/2)."""
  h = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
  angles = positions[:, None] * inv[None, :]
  cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
  rotated = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * cos[None, :, None] + rotated * sin[None, :, None]


def _silu(x):
  return x / (1.0 + np.exp(-x))


def forward_sites(params, tokens, config, edit=None):
  """tokens [B, T] -> (logits [B, T, V], {site name: value}) in float64. edit(name, value) -> value, if
  given, is called at every site (for reference edits)."""
  c = config
  p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
  edit = edit or (lambda name, value: value)
  sites = {}

  def at(name, value):
    value = edit(name, value)
    sites[name] = value
    return value

  b, t = tokens.shape
  x = at("hook_embed", p["embed.embedding"][np.asarray(tokens)])
  positions = np.arange(t, dtype=np.float64)
  for layer in range(c.n_layers):
    w = lambda name: p[f"blocks.{name}"][layer]  # noqa: E731
    pre = f"blocks.{layer}."
    x = at(pre + "hook_resid_pre", x)
    h = _rms(x, w("attn_norm.weight"), c.norm_eps)
    q = at(pre + "attn.hook_q", _project(h, p, layer, "q").reshape(b, t, c.n_heads, c.head_dim))
    k = at(pre + "attn.hook_k", _project(h, p, layer, "k").reshape(b, t, c.n_kv_heads, c.head_dim))
    v = at(pre + "attn.hook_v", _project(h, p, layer, "v").reshape(b, t, c.n_kv_heads, c.head_dim))
    q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
    group = c.n_heads // c.n_kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(c.head_dim)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    sites[pre + "attn.pattern_full"] = probs  # [B, N, T, S]
    z = at(pre + "attn.hook_z", np.einsum("bnqk,bknh->bqnh", probs, v))
    attn_out = at(pre + "hook_attn_out", z.reshape(b, t, -1) @ w("attn.o.kernel"))
    x = at(pre + "hook_resid_mid", x + attn_out)
    h = _rms(x, w("mlp_norm.weight"), c.norm_eps)
    hidden = at(pre + "mlp.hook_post", _silu(h @ w("mlp.gate.kernel")) * (h @ w("mlp.up.kernel")))
    mlp_out = at(pre + "hook_mlp_out", hidden @ w("mlp.down.kernel"))
    x = at(pre + "hook_resid_post", x + mlp_out)
  normed = at("ln_final.hook_normalized", _rms(x, p["final_norm.weight"], c.norm_eps))
  return normed @ p["lm_head.kernel"], sites


def _project(h, p, layer, name):
  """h @ W_name (+ its bias when the parameters have one) at `layer`."""
  out = h @ p[f"blocks.attn.{name}.kernel"][layer]
  bias = p.get(f"blocks.attn.{name}.bias")
  return out if bias is None else out + bias[layer]


def readout(params, x, config):
  """The final norm and LM head on residual values x [..., D] (NumPy, float64)."""
  p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
  return _rms(np.asarray(x, np.float64), p["final_norm.weight"], config.norm_eps) @ p["lm_head.kernel"]


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flat(value, name + "."))
    else:
      out[name] = value
  return out


def cached_kv(params, tokens, config):
  """Per layer, the post-RoPE keys and values [B, S, K, H] (float64) of a full forward of tokens [B, S]."""
  _, sites = forward_sites(params, tokens, config)
  positions = np.arange(tokens.shape[1], dtype=np.float64)
  return [(_rope(sites[f"blocks.{l}.attn.hook_k"], positions, config.rope_theta), sites[f"blocks.{l}.attn.hook_v"])
          for l in range(config.n_layers)]


def subset_forward(params, tokens, config, cache, queries, keys=None, return_cache=False, queries_out=None):
  """Logits [B, T, V] (float64) of a call that computes only the sequence positions queries [B, T] (entries
  equal to S: padding) of tokens [B, S], every other position's keys and values read from `cache` (per layer
  (keys, values) [B, S, K, H], `cached_kv`); keys: None, or per layer [L][B, m] the only cached positions the
  queries read besides their own (entries equal to S: none). return_cache: return (logits, the cache with the
  queries' fresh keys and values written at their positions); queries_out: a list that, if given, gets each layer's
  post-RoPE queries [B, T, N, H] appended."""
  c = config
  p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
  b, s = tokens.shape
  t = queries.shape[1]
  real = queries < s
  at = np.minimum(queries, s - 1)
  x = p["embed.embedding"][np.take_along_axis(np.asarray(tokens), at, axis=1)]
  group = c.n_heads // c.n_kv_heads
  written = []
  for layer in range(c.n_layers):
    w = lambda name: p[f"blocks.{name}"][layer]  # noqa: E731
    h = _rms(x, w("attn_norm.weight"), c.norm_eps)
    out = np.zeros((b, t, c.n_heads, c.head_dim))
    written.append((np.array(cache[layer][0]), np.array(cache[layer][1])))
    layer_q = np.zeros((b, t, c.n_heads, c.head_dim))
    for row in range(b):
      pos = at[row].astype(np.float64)
      q = _rope(_project(h[row:row + 1], p, layer, "q").reshape(1, t, c.n_heads, c.head_dim), pos,
                c.rope_theta)[0]
      layer_q[row] = q
      k_new = _rope(_project(h[row:row + 1], p, layer, "k").reshape(1, t, c.n_kv_heads, c.head_dim), pos,
                    c.rope_theta)[0]
      v_new = _project(h[row], p, layer, "v").reshape(t, c.n_kv_heads, c.head_dim)
      k_all, v_all = np.array(cache[layer][0][row]), np.array(cache[layer][1][row])
      for i in range(t):
        if real[row, i]:
          k_all[queries[row, i]], v_all[queries[row, i]] = k_new[i], v_new[i]
      written[layer][0][row], written[layer][1][row] = k_all, v_all
      if keys is None:
        read = list(range(s))
      else:
        read = sorted({int(j) for j in keys[layer][row] if j < s} | {int(j) for j in queries[row] if j < s})
      kk, vv = np.repeat(k_all[read], group, axis=1), np.repeat(v_all[read], group, axis=1)
      scores = np.einsum("qnh,knh->nqk", q, kk) / np.sqrt(c.head_dim)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      probs = probs / probs.sum(-1, keepdims=True)
      out[row] = np.einsum("nqk,knh->qnh", probs, vv)
    if queries_out is not None:
      queries_out.append(layer_q)
    x = x + out.reshape(b, t, -1) @ w("attn.o.kernel")
    h = _rms(x, w("mlp_norm.weight"), c.norm_eps)
    x = x + (_silu(h @ w("mlp.gate.kernel")) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  logits = _rms(x, p["final_norm.weight"], c.norm_eps) @ p["lm_head.kernel"]
  return (logits, written) if return_cache else logits


def trunk_flops(config, rows, keys):
  """The analytic matmul FLOPs of `rows` queries through every layer of this model, each attending over `keys` key
  slots (no LM head, norms, softmax or RoPE): per layer 2 x rows x the q/k/v/o and SwiGLU weights, and
  4 x rows x keys x N x H for the scores and the weighted sum."""
  d, n, kv, h, f = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.mlp_hidden
  weights = d * n * h + 2 * d * kv * h + n * h * d + 3 * d * f
  return config.n_layers * (2 * weights * rows + 4 * rows * keys * n * h)
