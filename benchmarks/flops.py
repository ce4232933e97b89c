"""Model FLOPs of one denoising step (kept free of absl flags so tests can import it)."""


def step_flops(width: int, layers: int, heads: int, mlp: int, vocab: int, seq: int, window: int) -> int:
  """FLOPs of one step for MHA with head dim H = width / heads, S = seq, W = window (logits):

  layers · (2·S·D·3·N·H + 2·S·N·H·D + 6·S·D·F + 4·S²·N·H) + 2·W·D·V.
  """
  head_dim = width // heads
  per_layer = (2 * seq * width * 3 * heads * head_dim + 2 * seq * heads * head_dim * width + 6 * seq * width * mlp
               + 4 * seq * seq * heads * head_dim)
  return layers * per_layer + 2 * window * width * vocab
