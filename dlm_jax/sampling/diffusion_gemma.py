"""DiffusionGemma's uniform-state block diffusion (transformers 5.23 `DiffusionGemmaGenerationMixin.generate`)
as one compiled program on the driver.

The generation is n = G / C canvases of C = `canvas_length` tokens, produced one after the other. Canvas k
(a driver `Phase`, arg k) opens with one encoder call — the prompt [B, Lp] for k = 0, else the finished
canvas k−1 — that writes its keys and values into the KV cache at its positions (the cache commit), then
runs at most `max_denoising_steps` = N decoder steps over the canvas at positions Lp + k·C.. (reading the
cache, writing nothing). There is no mask token: the canvas starts as uniformly random ids. Decoder step
s = 0, 1, … of a canvas (HF's `cur_step` = N − s counts down):

  1. logits = decoder(canvas, cache, self-conditioning logits of the previous step; none at s = 0);
  2. temperature T = t_min + (t_max − t_min)·(N − s)/N (0.8 → 0.408 with the defaults), z = logits / T;
  3. a sample of every position from softmax(z) (Gumbel-max: argmax(z + g)), and argmax(z);
  4. entropy-bound acceptance: positions sorted by the entropy H of softmax(z), ascending, are accepted while
     (cumulative H − own H) <= `entropy_bound` (so at least one); accepted positions take the sample, all the
     others get fresh uniform ids over the whole vocabulary (renoising — nothing is frozen across steps);
  5. adaptive stopping: a row is done with the canvas when argmax(z) equals the argmax of each of the previous
     `stability_threshold` steps and mean H < `confidence_threshold`; a done row keeps its canvas, argmax
     and self-conditioning logits while the others go on, and the canvas ends when every row is done;
  6. z (in the embedding dtype) is the next step's self-conditioning input.

The canvas kept is the last argmax (not the sampled canvas). With `eos_stop`, a row whose canvas holds the
EOS id gets pad after its first EOS and stops: its later canvases are pad and it runs no more decoder
steps; the run ends when every row has stopped. (HF keeps denoising a stopped row's canvas — rows are
independent — and overwrites it with pad, so it can run more decoder passes for the same tokens; its
`tokens_per_forward` excludes those rows' passes, as `DiffusionGemmaCarry.passes` does.) Rows that are
done wait unchanged — their intervention state too (`Intervention.keep_rows`; an encoder call updates
every row's) — while the batch's calls run (`StepOutput.active`); the encoder calls decode no row.

Random draws are a pure function of the run key, the canvas and the step (`canvas_draws`, `step_draws`), so
a test can rebuild them and feed the same canvases, Gumbel noise and renoising ids to a reference.
Statistics are over the S = Lp + G cache positions (prompt keys, then the canvases; a decoder step's
canvas at its own positions), per layer in absolute order. Left-padded prompts use the padding key bias.
Query groups (`dlm_jax.instrument.stats.QUERY_GROUP_NAMES`) have no mask token to go by: at a decoder step, "masked"
are the canvas positions not holding a token the previous step accepted (the whole initial canvas at
step 0, then the renoised positions) and "unmasked" the accepted ones; at an encoder call the prompt's
queries are "prompt" and a finished canvas's queries "unmasked".

Interventions act at every model call, encoder and decoder, as attention biases over the S cache positions
(`CallContext.query_offset` is the call's first position). `MaskPreviousSinks` masks at each call the top
sinks of the row's previous model call, whatever its kind: a canvas's first decoder step masks the sinks of
its encoder commit, and a commit those of the previous canvas's last decoder step. Keys and values the
encoder writes keep the bias of their commit. `SinkToken("front")` (the sink as the prompt's first token,
`dlm_jax.instrument.interventions.add_sink_token`): under the causal encoder the sink's row sees only itself anyway;
every later query sees it in global layers, but in sliding-window layers only while it is inside the window
(an encoder query at i sees i−W+1..i there, a decoder step at positions P.. the cache positions P−W+1..P−1:
the sink drops out once P >= W).
`SinkToken("end")` is refused: the last position lies on the last canvas, which is renoised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.instrument import interventions
from dlm_jax.config import ModelConfig
from dlm_jax.model import DecoderCall, KVCache
from dlm_jax.sampling import driver, keys, padding
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Readout


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaOptions:
  """Every knob of `DiffusionGemmaGenerationConfig`, with its defaults.

  gen_length: generated tokens G (HF max_new_tokens 256); a multiple of canvas_length.
  canvas_length: C, the block length (HF config.canvas_length 256).
  max_denoising_steps: N, the most decoder steps per canvas (48).
  entropy_bound: the acceptance bound (EntropyBoundSamplerConfig.entropy_bound 0.1).
  t_min, t_max: the temperature schedule's last-step and first-step values (0.4, 0.8).
  stability_threshold: previous steps whose argmax must equal the current one (1; 0 = always stable).
  confidence_threshold: mean-entropy bound of the stopping rule (0.005); None disables adaptive stopping
    (every canvas then runs N steps, as HF when either threshold is None).
  eos_stop: stop a row at the first canvas holding EOS and pad after it (HF's EOS criterion).
  """

  gen_length: int = 256
  canvas_length: int = 256
  max_denoising_steps: int = 48
  entropy_bound: float = 0.1
  t_min: float = 0.4
  t_max: float = 0.8
  stability_threshold: int = 1
  confidence_threshold: float | None = 0.005
  eos_stop: bool = True

  def __post_init__(self):
    for name in ("gen_length", "canvas_length", "max_denoising_steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DiffusionGemmaOptions.{name} must be a positive integer, got {value!r}.")
    if self.gen_length % self.canvas_length:
      raise ValueError(f"DiffusionGemmaOptions.gen_length ({self.gen_length}) must be a multiple of canvas_length "
                       f"({self.canvas_length}); HF generates whole canvases.")
    for name in ("entropy_bound", "t_min", "t_max"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"DiffusionGemmaOptions.{name} must be a positive number, got {value!r}.")
    threshold = self.stability_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
      raise ValueError(f"DiffusionGemmaOptions.stability_threshold must be an integer >= 0, got {threshold!r}.")
    confidence = self.confidence_threshold
    if confidence is not None and (isinstance(confidence, bool) or not isinstance(confidence, (int, float))):
      raise ValueError(f"DiffusionGemmaOptions.confidence_threshold must be None or a number, got {confidence!r}.")

  @property
  def n_canvases(self) -> int:
    return self.gen_length // self.canvas_length


def temperature(options: DiffusionGemmaOptions, step) -> jax.Array:
  """T at decoder step `step` (0-based) of a canvas: t_min + (t_max − t_min)·(N − step)/N."""
  n = options.max_denoising_steps
  return options.t_min + (options.t_max - options.t_min) * (n - step) / n


def _fold(key: jax.Array, data, per_row: bool) -> jax.Array:
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, data) if per_row else jax.random.fold_in(key, data)


def canvas_draws(key: jax.Array, canvas: int, shape: tuple[int, int], vocab_size: int, per_row: bool) -> jax.Array:
  """The initial canvas [B, C] int32 of canvas `canvas` (uniform ids in [0, V)), from the run key."""
  uniform = keys.uniform(_fold(key, 2 * canvas, per_row), shape, jnp.float32, 0.0, 1.0, per_row)
  return jnp.clip((uniform * vocab_size).astype(jnp.int32), 0, vocab_size - 1)


def step_draws(key: jax.Array, canvas: int | jax.Array, step: jax.Array, shape: tuple[int, int], vocab_size: int,
               per_row: bool) -> tuple[jax.Array, jax.Array]:
  """(gumbel [B, C, V] float32, renoise [B, C] int32 uniform ids) of decoder step `step` of canvas `canvas`."""
  k = _fold(_fold(key, 2 * canvas + 1, per_row), step, per_row)
  k_gumbel, k_renoise = keys.split(k, 2, per_row)
  gumbel = keys.gumbel(k_gumbel, (*shape, vocab_size), jnp.float32, per_row)
  uniform = keys.uniform(k_renoise, shape, jnp.float32, 0.0, 1.0, per_row)
  return gumbel, jnp.clip((uniform * vocab_size).astype(jnp.int32), 0, vocab_size - 1)


def entropy_bound_accept(scaled_logits: jax.Array, bound: float) -> tuple[jax.Array, jax.Array]:
  """(accepted [B, C] bool, entropy [B, C] float32) of temperature-scaled logits [B, C, V]: positions in
  ascending entropy order are accepted while (cumulative entropy − own entropy) <= bound."""
  logp = jax.nn.log_softmax(scaled_logits.astype(jnp.float32), axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  order = jnp.argsort(entropy, axis=-1, stable=True)
  sorted_entropy = jnp.take_along_axis(entropy, order, axis=-1)
  keep_sorted = jnp.cumsum(sorted_entropy, axis=-1) - sorted_entropy <= bound
  rows = jnp.arange(entropy.shape[0])[:, None]
  accepted = jnp.zeros(entropy.shape, bool).at[rows, order].set(keep_sorted)
  return accepted, entropy


def pad_after_eos(tokens: jax.Array, eos_id: int, pad_id: int) -> jax.Array:
  """[B, C] with every position after a row's first EOS replaced by pad (the EOS kept)."""
  is_eos = tokens == eos_id
  seen = jnp.cumsum(is_eos, axis=-1)
  return jnp.where((seen > 0) & ~((seen == 1) & is_eos), pad_id, tokens)


@struct.dataclass
class DiffusionGemmaCarry:
  """tokens [B, S] (prompt, then the canvases: done ones finalised, the current one its latest argmax, later
  ones pad); canvas [B, C] the current noisy canvas; argmax [B, C]; sc_logits [B, C, V] the previous
  step's scaled logits (embedding dtype) and has_sc [B]; history [max(1, k), B, C] the last k argmax
  canvases (−1 = none); denoise_done, stopped [B] bool (done with the canvas; stopped at EOS before it);
  canvas_eos [B] bool (the current argmax canvas holds EOS); accepted [B, C] bool: the canvas positions
  holding the token the previous decoder step accepted (all False at the canvas's opening; kept while the
  row waits), the complement of the masked query group; block, block_step: the canvas in progress
  (−1 before the first) and its decoder steps so far; cache: the `KVCache`; decode_step [B, G]: the
  driver step that last set each generated token (the canvas's last active step); passes [B] decoder
  steps each row was active in (HF tokens_per_forward's denominator)."""

  tokens: jax.Array
  canvas: jax.Array
  argmax: jax.Array
  sc_logits: jax.Array
  has_sc: jax.Array
  history: jax.Array
  denoise_done: jax.Array
  stopped: jax.Array
  canvas_eos: jax.Array
  accepted: jax.Array
  block: jax.Array
  block_step: jax.Array
  cache: KVCache
  key: jax.Array
  decode_step: jax.Array
  passes: jax.Array


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaFamily(driver.Family):
  """The DiffusionGemma sampler (module docstring) with its resolved ids."""

  eos_id: int | None
  pad_id: int

  name = "diffusion_gemma"
  padding_attention = "key"
  shift_positions = False
  can_finish_early = True

  @property
  def fill_id(self) -> int:
    return self.pad_id

  @property
  def n_steps(self) -> int:
    return self.options.max_denoising_steps

  def check(self, config: ModelConfig, intervention: interventions.Intervention) -> None:
    """Refuses a non-DiffusionGemma model and `SinkToken(position="end")` (module docstring, "Interventions")."""
    interventions.refuse_end_sink_token(intervention, "DiffusionGemma sampling", "the last position lies on the "
                                        "last canvas, whose tokens are renoised at every decoder step, so no sink "
                                        "token stays there")
    if not (config.self_conditioning and config.causal):
      raise ValueError(f"DiffusionGemma sampling needs a DiffusionGemma model (causal encoder, self-conditioning "
                       f"decoder); config {config.name!r} has causal={config.causal}, "
                       f"self_conditioning={config.self_conditioning}.")

  def phases(self, run) -> tuple[driver.Phase, ...]:
    """One phase per canvas: its encoder call (the prompt, or the previous canvas) opens it, then at most N
    decoder steps."""
    return tuple(driver.Phase(arg=k, steps=self.options.max_denoising_steps, opening=True)
                 for k in range(self.options.n_canvases))

  def init_carry(self, run, params, sequence, key, consts) -> DiffusionGemmaCarry:
    b, c = sequence.shape[0], self.options.canvas_length
    dtype = params["embed"]["embedding"].dtype
    false = jnp.zeros((b,), bool)
    return DiffusionGemmaCarry(
        tokens=sequence, canvas=jnp.zeros((b, c), jnp.int32), argmax=jnp.zeros((b, c), jnp.int32),
        sc_logits=jnp.zeros((b, c, run.config.vocab_size), dtype), has_sc=false,
        history=jnp.full((max(1, self.options.stability_threshold), b, c), -1, jnp.int32), denoise_done=false,
        stopped=false, canvas_eos=false, accepted=jnp.zeros((b, c), bool), block=jnp.int32(-1),
        block_step=jnp.int32(0),
        cache=KVCache.zeros(run.config, b, run.total_length, dtype), key=key,
        decode_step=jnp.full((b, self.gen_length), -1, jnp.int32), passes=jnp.zeros((b,), jnp.int32))

  def _finished_rows(self, carry: DiffusionGemmaCarry) -> jax.Array:
    """[B] rows that stopped at EOS, counting the canvas just finished."""
    return carry.stopped | (carry.canvas_eos if self.options.eos_stop else False)

  def finished(self, run, consts, carry: DiffusionGemmaCarry, i, phase) -> jax.Array:
    """Before canvas k's opening (block == k−1): every row stopped at EOS. During canvas k: every row done."""
    k = phase.arg
    before = jnp.all(self._finished_rows(carry)) if k > 0 else jnp.zeros((), bool)
    return jnp.where(carry.block == k, jnp.all(carry.denoise_done), before)

  def open_phase(self, run, params, layout: padding.PaddingLayout, carry: DiffusionGemmaCarry, istate, i, phase):
    """Commit: the encoder call over the prompt (k = 0) or the finished canvas k−1, writing the cache; then
    canvas k's draws and a fresh stopping state."""
    o, k, lp = self.options, phase.arg, run.prompt_length
    c = o.canvas_length
    start, stop = (0, lp) if k == 0 else (lp + (k - 1) * c, lp + k * c)
    stopped = self._finished_rows(carry)
    x = carry.tokens
    inputs = CallInputs(x[:, start:stop], layout.positions[:, start:stop], layout.valid[:, start:stop],
                        layout.valid & (jnp.arange(run.total_length) < stop)[None, :],
                        padding.query_rows(layout.bias, start, stop - start))
    result = run.caller(params, i, istate, inputs, Readout(window=(stop - start - 1, stop - start)),
                        CacheCall(carry.cache, start, x))
    b = x.shape[0]
    canvas = canvas_draws(carry.key, k, (b, c), run.config.vocab_size, run.row_keys)
    s = lp + k * c
    tokens = x.at[:, s:s + c].set(jnp.where(stopped[:, None], self.pad_id, x[:, s:s + c]))
    carry = carry.replace(
        tokens=tokens, canvas=canvas, argmax=canvas, has_sc=jnp.zeros((b,), bool),
        history=jnp.full_like(carry.history, -1), denoise_done=stopped, stopped=stopped,
        canvas_eos=jnp.zeros((b,), bool), accepted=jnp.zeros((b, c), bool), block=jnp.int32(k),
        block_step=jnp.int32(0), cache=result.cache)
    outputs = result.outputs.replace(active=jnp.zeros((b,), bool), queries=jnp.array([start, stop], jnp.int32),
                                     accepted=jnp.zeros((b, c), bool), canvas=jnp.zeros((b, c), jnp.int32))
    return carry, result.state, outputs

  def step(self, run, params, layout: padding.PaddingLayout, carry: DiffusionGemmaCarry, istate, i, phase):
    """One decoder step of canvas k (module docstring, 1–6)."""
    o, k, lp = self.options, phase.arg, run.prompt_length
    c = o.canvas_length
    s = lp + k * c
    b = carry.canvas.shape[0]
    active = ~carry.denoise_done
    sequence = carry.tokens.at[:, s:s + c].set(carry.canvas)
    inputs = CallInputs(carry.canvas, layout.positions[:, s:s + c], layout.valid[:, s:s + c],
                        layout.valid & (jnp.arange(run.total_length) < s + c)[None, :],
                        padding.query_rows(layout.bias, s, c), unresolved=~carry.accepted)
    decoder = DecoderCall(self_conditioning_logits=carry.sc_logits, self_conditioning_mask=carry.has_sc)
    result = run.caller(params, i, istate, inputs, Readout(),
                        CacheCall(carry.cache, s, sequence, mode="decode", decoder=decoder))
    scaled = result.logits / temperature(o, carry.block_step)
    gumbel, renoise = step_draws(carry.key, k, carry.block_step, (b, c), run.config.vocab_size, run.row_keys)
    sample = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
    argmax = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    accepted, entropy = entropy_bound_accept(scaled, o.entropy_bound)
    renoised = jnp.where(accepted, sample, renoise)
    keep = ~active[:, None]
    argmax = jnp.where(keep, carry.argmax, argmax)
    read = carry.canvas
    canvas = jnp.where(keep, carry.canvas, renoised)
    sc_logits = jnp.where(keep[..., None], carry.sc_logits, scaled.astype(carry.sc_logits.dtype))
    done = carry.denoise_done
    if o.confidence_threshold is not None:
      stable = jnp.ones((b,), bool)
      if o.stability_threshold:
        stable = jnp.all(carry.history == argmax[None], axis=(0, 2))
      confident = jnp.mean(entropy, axis=-1) < o.confidence_threshold
      done = done | (active & stable & confident)
    history = jnp.concatenate([carry.history[1:], argmax[None]], axis=0)
    finalised = argmax if self.eos_id is None else pad_after_eos(argmax, self.eos_id, self.pad_id)
    finalised = jnp.where(carry.stopped[:, None], self.pad_id, finalised)
    canvas_eos = jnp.zeros((b,), bool) if self.eos_id is None else jnp.any(argmax == self.eos_id, axis=-1)
    g = s - lp
    decode_step = carry.decode_step.at[:, g:g + c].set(
        jnp.where(active[:, None], i, carry.decode_step[:, g:g + c]))
    carry = carry.replace(tokens=carry.tokens.at[:, s:s + c].set(finalised), canvas=canvas, argmax=argmax,
                          sc_logits=sc_logits, has_sc=jnp.ones((b,), bool), history=history, denoise_done=done,
                          canvas_eos=canvas_eos & ~carry.stopped, accepted=jnp.where(keep, carry.accepted, accepted),
                          block_step=carry.block_step + 1, decode_step=decode_step,
                          passes=carry.passes + active.astype(jnp.int32))
    outputs = result.outputs.replace(active=active, queries=jnp.array([s, s + c], jnp.int32),
                                     accepted=accepted & active[:, None], canvas=read)
    return carry, result.state, outputs

  def outcome(self, run, carry: DiffusionGemmaCarry) -> tuple[jax.Array, jax.Array]:
    return carry.tokens, carry.decode_step


def build_family(config: ModelConfig, options: DiffusionGemmaOptions, prompt) -> DiffusionGemmaFamily:
  del prompt
  if config.pad_token_id is None:
    raise ValueError(f"DiffusionGemma sampling fills finished rows with the pad id; config {config.name!r} has "
                     "pad_token_id=None.")
  if options.eos_stop and config.eos_token_id is None:
    raise ValueError(f"DiffusionGemmaOptions.eos_stop=True needs config.eos_token_id; config {config.name!r} has "
                     "none (set eos_stop=False).")
  return DiffusionGemmaFamily(options=options, eos_id=config.eos_token_id if options.eos_stop else None,
                              pad_id=config.pad_token_id)


generate = driver.public_sampler(build_family, DiffusionGemmaOptions(), """DiffusionGemma block diffusion.

  params, prompt [B, Lp], config (a DiffusionGemma model), options (`DiffusionGemmaOptions`), and the driver's
  keyword arguments (`dlm_jax.sampling.driver.run_family`: key, prompt_mask, setup).
  Returns the `Trace`: tokens [B, Lp + G] (pad after a row's first EOS), decode_step [B, G] (the last decoder
  step that denoised the token's canvas for its row), nfe (encoder and decoder calls), active_rows
  [max_steps, B] (the rows each decoder step denoised; none at the encoder calls), accepted
  [max_steps, B, C] (the positions each step accepted), canvases [max_steps, B, C] (the canvas each decoder
  step read), and the statistics of every call over the Lp + G cache positions.
  """)
