"""The index set `torch.topk(x, k)` (largest) returns on CPU, ties included, as a jit-able JAX function.

Where scores tie at the k-th value (routine after a max-pool: a local maximum repeats over the pooling
window), the chosen *set* depends on the selection algorithm. PyTorch's CPU kernel (`topk_impl_loop` in
ATen) fills a queue of (value, index) pairs in index order, then runs libstdc++'s `std::partial_sort`
when k * 64 <= n and `std::nth_element` at k - 1 otherwise, comparing values only (`x.first >
y.first`). This module replays those two algorithms step by step (introselect: median-of-three pivot,
unguarded partition, depth limit 2 * floor(log2 n) then heap select, insertion sort of the last <= 3
elements; heap select: make_heap, then replace the heap top by every later element that beats it), so the
chosen set equals torch's on CPU with libstdc++ (Linux builds); the tests check it against `torch.topk`
itself. The sort torch applies
afterwards (`sorted=True`) only orders the set. CUDA's top-k is a different algorithm (not replayed).

Costs: a sequential loop of O(n) expected scalar steps per row (rows run one after the other), meant for
a selection made once per block and layer, not per step. NaN scores are not supported (torch sorts them
first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _swap(state, i, j):
  values, order = state
  vi, vj, oi, oj = values[i], values[j], order[i], order[j]
  return values.at[i].set(vj).at[j].set(vi), order.at[i].set(oj).at[j].set(oi)


def _push_heap(state, first, hole, top, value, index):
  """libstdc++ __push_heap on the heap at `first`: sift (value, index) up from `hole` to `top`."""
  values, order = state

  def cond(carry):
    values, _, hole = carry
    parent = (hole - 1) // 2
    return (hole > top) & (values[first + jnp.maximum(parent, 0)] > value)

  def body(carry):
    values, order, hole = carry
    parent = (hole - 1) // 2
    return (values.at[first + hole].set(values[first + parent]), order.at[first + hole].set(order[first + parent]),
            parent)

  values, order, hole = jax.lax.while_loop(cond, body, (values, order, hole))
  return values.at[first + hole].set(value), order.at[first + hole].set(index)


def _adjust_heap(state, first, hole, length, value, index):
  """libstdc++ __adjust_heap: move the hole at `hole` down to a leaf, then push (value, index) up."""
  top = hole

  def cond(carry):
    return carry[3] < (length - 1) // 2

  def body(carry):
    values, order, hole, second = carry
    second = 2 * (second + 1)
    second = jnp.where(values[first + second] > values[first + second - 1], second - 1, second)
    return (values.at[first + hole].set(values[first + second]), order.at[first + hole].set(order[first + second]),
            second, second)

  values, order, hole, second = jax.lax.while_loop(cond, body, (*state, hole, hole))
  tail = ((length & 1) == 0) & (second == (length - 2) // 2)
  child = 2 * (second + 1) - 1
  values = jnp.where(tail, values.at[first + hole].set(values[first + child]), values)
  order = jnp.where(tail, order.at[first + hole].set(order[first + child]), order)
  hole = jnp.where(tail, child, hole)
  return _push_heap((values, order), first, hole, top, value, index)


def _heap_select(state, first, middle, last):
  """libstdc++ __heap_select: a heap of [first, middle), then every element of [middle, last) that beats
  its top replaces it."""
  length = middle - first

  def make_body(step, state):
    parent = (length - 2) // 2 - step
    values, order = state
    return _adjust_heap(state, first, parent, length, values[first + parent], order[first + parent])

  state = jax.lax.fori_loop(0, jnp.maximum((length - 2) // 2 + 1, 0) * (length >= 2), make_body, state)

  def select_body(i, state):
    values, order = state

    def replace(state):
      values, order = state
      value, index = values[i], order[i]
      values, order = values.at[i].set(values[first]), order.at[i].set(order[first])
      return _adjust_heap((values, order), first, 0, length, value, index)

    return jax.lax.cond(values[i] > values[first], replace, lambda s: s, state)

  return jax.lax.fori_loop(middle, last, select_body, state)


def _partition_pivot(state, first, last):
  """libstdc++ __unguarded_partition_pivot: median of (first + 1, mid, last - 1) moved to first, then
  the unguarded partition of [first + 1, last) around it. Returns (state, cut)."""
  values = state[0]
  a, b, c = first + 1, first + (last - first) // 2, last - 1
  va, vb, vc = values[a], values[b], values[c]
  median = jnp.where(va > vb, jnp.where(vb > vc, b, jnp.where(va > vc, c, a)),
                     jnp.where(va > vc, a, jnp.where(vb > vc, c, b)))
  state = _swap(state, first, median)
  pivot = state[0][first]

  def outer_cond(carry):
    return ~carry[4]

  def outer_body(carry):
    values, order, left, right, _ = carry
    left = jax.lax.while_loop(lambda i: values[i] > pivot, lambda i: i + 1, left)
    right = jax.lax.while_loop(lambda i: pivot > values[i], lambda i: i - 1, right - 1)
    done = left >= right
    swapped = _swap((values, order), left, right)
    values = jnp.where(done, values, swapped[0])
    order = jnp.where(done, order, swapped[1])
    return values, order, jnp.where(done, left, left + 1), right, done

  values, order, cut, _, _ = jax.lax.while_loop(outer_cond, outer_body, (*state, first + 1, last, False))
  return (values, order), cut


def _insertion_sort(state, first, last):
  """libstdc++ __insertion_sort of [first, last) (strict comparison: equal values keep their order)."""

  def insert(i, state):
    values, order = state
    value, index = values[i], order[i]

    def cond(carry):
      return (carry[2] > first) & (value > carry[0][carry[2] - 1])

    def body(carry):
      values, order, j = carry
      return values.at[j].set(values[j - 1]), order.at[j].set(order[j - 1]), j - 1

    values, order, j = jax.lax.while_loop(cond, body, (values, order, i))
    return values.at[j].set(value), order.at[j].set(index)

  return jax.lax.fori_loop(first + 1, last, insert, state)


def _nth_element(state, nth, n):
  """libstdc++ std::nth_element (introselect) of [0, n) at `nth` (n: int or traced int32 >= 1)."""
  depth = 2 * (31 - jax.lax.clz(jnp.asarray(n, jnp.int32)))

  def cond(carry):
    _, _, first, last, depth_left, heap_done = carry
    return (last - first > 3) & ~heap_done

  def body(carry):
    values, order, first, last, depth_left, _ = carry

    def by_heap(args):
      values, order, first, last = args
      state = _heap_select((values, order), first, nth + 1, last)
      values, order = _swap(state, first, nth)
      return values, order, first, last, True

    def by_partition(args):
      values, order, first, last = args
      (values, order), cut = _partition_pivot((values, order), first, last)
      return values, order, jnp.where(cut <= nth, cut, first), jnp.where(cut <= nth, last, cut), False

    values, order, first, last, heap_done = jax.lax.cond(depth_left == 0, by_heap, by_partition,
                                                         (values, order, first, last))
    return values, order, first, last, depth_left - 1, heap_done

  values, order, first, last, _, heap_done = jax.lax.while_loop(
      cond, body, (*state, jnp.int32(0), jnp.asarray(n, jnp.int32), depth, False))
  return jax.lax.cond(heap_done, lambda s: s, lambda s: _insertion_sort(s, first, last), (values, order))


def torch_cpu_top_k(scores: jax.Array, k: int) -> jax.Array:
  """The positions `torch.topk(scores, k)` picks on CPU, as a bool mask: scores [B, n] float32 (no NaN),
  k a Python int in [0, n] -> [B, n] bool with k True per row."""
  n = scores.shape[-1]
  if not 0 <= k <= n:
    raise ValueError(f"top-k count must be in [0, {n}], got {k}.")
  if k == 0:
    return jnp.zeros(scores.shape, bool)

  def one_row(row):
    state = (row, jnp.arange(n, dtype=jnp.int32))
    if k * 64 <= n:
      _, order = _heap_select(state, jnp.int32(0), jnp.int32(k), jnp.int32(n))
    else:
      _, order = _nth_element(state, jnp.int32(k - 1), n)
    return jnp.zeros(n, bool).at[order[:k]].set(True)

  return jax.lax.map(one_row, scores)


def torch_cpu_top_k_prefix(scores: jax.Array, k: jax.Array, n: jax.Array) -> jax.Array:
  """The positions `torch.topk(scores[:, :n], k)` picks on CPU, with n and k traced: scores [B, W] float32 (no
  NaN in the first n), n: scalar int32 in [1, W], k: scalar int32 in [0, n] -> [B, W] bool, k True per row, none
  at or after n. The same replay as `torch_cpu_top_k` (its branch on k * 64 <= n taken with `lax.cond`), which
  touches positions [0, n) only, so a static width serves every n."""
  width = scores.shape[-1]
  k, n = jnp.asarray(k, jnp.int32), jnp.asarray(n, jnp.int32)

  def one_row(row):
    state = (row, jnp.arange(width, dtype=jnp.int32))
    order = jax.lax.cond(k * 64 <= n, lambda s: _heap_select(s, jnp.int32(0), k, n)[1],
                         lambda s: _nth_element(s, jnp.maximum(k - 1, 0), n)[1], state)
    return jnp.zeros(width, bool).at[order].set(jnp.arange(width) < k)

  return jax.lax.map(one_row, scores)
