"""KV-cache arithmetic, mirroring vLLM 0.32 line by line (pure).

For a uniform full-attention model the predicted token count is the number vLLM logs:

- page size of one layer = KV heads × block_size × (head_size + head_size_v) × dtype bytes
  (`v1/kv_cache_interface.py` `AttentionSpec.page_size_bytes`); for MLA one head of the latent size, no V;
- bytes per block = sum of the layers' pages (`v1/core/kv_cache_utils.py` `_get_kv_cache_bytes_per_block`;
  the block-stride alignment is 1 for the CPU and FlashAttention backends, which declare `MultipleOf`
  kernel block sizes);
- num_blocks = available KV memory // bytes per block (`get_kv_cache_config_from_groups`);
- max concurrency = num_blocks / cdiv(max_model_len, block_size), and the logged "KV cache size: N tokens"
  is `int(max_concurrency * max_model_len)` (`get_kv_cache_capacity`) — not num_blocks × block_size when
  max_model_len is not a multiple of the block size;
- the start-up check and the refusal's "estimated maximum model length" plan against the available memory
  minus ONE block, the null block the BlockPool keeps (`get_kv_cache_configs`: `check_memory = avail_mem -
  _pool_bytes_per_block(...)`), so 1,000,000 bytes at 16,384 bytes per block give 61 blocks = 1,952 tokens
  but an estimated maximum length of 60 × 32 = 1,920; the estimate is vLLM's binary search
  (`_estimate_max_model_len_from_groups`), reproduced here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunerd.core.model import DTYPE_BYTES, ModelInfo

_FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")


class KVEstimateUnavailable(ValueError):
    """The KV cache of this model/configuration cannot be computed exactly; the message says why."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as `vllm.utils.math_utils.cdiv`."""
    return -(a // -b)


def kv_dtype_bytes(model: ModelInfo, kv_cache_dtype: str | None) -> int:
    """Bytes per element of the KV cache. `auto`/None: the model's serving dtype; fp8 variants: 1.

    Quantized formats with per-token scales or packed sub-byte values (int8/fp8_per_token_head, int4,
    nvfp4, turboquant, fp8_ds_mla) have page sizes this planner does not model: they raise.
    """
    if kv_cache_dtype in (None, "auto"):
        return model.dtype_bytes
    name = kv_cache_dtype.lower()
    if name in _FP8_KV:
        return 1
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    raise KVEstimateUnavailable(f"--kv-cache-dtype {kv_cache_dtype}: page size not modelled by the planner")


@dataclass(frozen=True)
class KVLayout:
    """How one model's KV cache is laid out for one (dtype, block size): the divisor vLLM uses."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int
    values_stored: bool  # False for MLA (no separate V)

    @property
    def bytes_per_token_per_layer(self) -> int:
        # AttentionSpec.state_content_size_bytes = (head_size + head_size_v) * dtype; MLA head_size_v = 0.
        per_head = (self.head_dim + (self.head_dim if self.values_stored else 0)) * self.dtype_bytes
        return self.num_kv_heads * per_head

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token over all layers: layers × KV heads × head_dim × 2 × dtype bytes."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def page_size_bytes(self) -> int:
        """One layer's page: `AttentionSpec.page_size_bytes` = heads × block_size × content bytes."""
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """The pool divisor: the layers' pages summed (`_get_kv_cache_bytes_per_block`, alignment 1)."""
        return self.num_layers * self.page_size_bytes


def kv_layout(model: ModelInfo, kv_cache_dtype: str | None, block_size: int) -> KVLayout:
    """The model's KV layout, or `KVEstimateUnavailable` (sliding window, hybrid, unknown dtype …)."""
    if model.kv_unavailable_reason:
        raise KVEstimateUnavailable(model.kv_unavailable_reason)
    return KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype_bytes=kv_dtype_bytes(model, kv_cache_dtype),
        block_size=block_size,
        values_stored=model.kv_values_stored,
    )


def kv_bytes_per_token(model: ModelInfo, kv_cache_dtype: str | None = None) -> int:
    """KV-cache bytes per token (block size does not matter for the per-token figure)."""
    return kv_layout(model, kv_cache_dtype, 16).bytes_per_token


def num_blocks_for(available_bytes: int, layout: KVLayout) -> int:
    """Blocks vLLM allocates from `available_bytes` (`get_kv_cache_config_from_groups`)."""
    return max(0, available_bytes) // layout.bytes_per_block


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    """Blocks one request of `max_model_len` tokens holds (`FullAttentionSpec.max_memory_usage_bytes`)."""
    return cdiv(max_model_len, block_size)


def max_concurrency(num_blocks: int, max_model_len: int, block_size: int) -> float:
    """`get_max_concurrency_for_kv_cache_config`: num_blocks / blocks per request (a float)."""
    return num_blocks / blocks_per_request(max_model_len, block_size)


def kv_cache_tokens(num_blocks: int, max_model_len: int, block_size: int) -> int:
    """The "KV cache size: N tokens" vLLM logs: `int(max_concurrency * max_model_len)` (same float ops)."""
    return int(max_concurrency(num_blocks, max_model_len, block_size) * max_model_len)


def blocks_from_logged_tokens(tokens: int, max_model_len: int, block_size: int) -> int:
    """Invert `kv_cache_tokens`: the num_blocks whose logged token count is `tokens` (raises if none)."""
    per_request = blocks_per_request(max_model_len, block_size)
    guess = tokens * per_request // max_model_len
    for candidate in range(max(0, guess - 2), guess + 4):
        if kv_cache_tokens(candidate, max_model_len, block_size) == tokens:
            return candidate
    raise ValueError(f"no block count gives {tokens} tokens at max_model_len {max_model_len}")


def request_fits(available_bytes: int, max_model_len: int, layout: KVLayout) -> bool:
    """vLLM's start-up check: one request of `max_model_len` fits in the memory minus the null block."""
    check_memory = available_bytes - layout.bytes_per_block
    if check_memory <= 0:
        return False
    return blocks_per_request(max_model_len, layout.block_size) * layout.bytes_per_block <= check_memory


def vllm_estimated_max_model_len(available_bytes: int, max_model_len: int, layout: KVLayout) -> int:
    """The "estimated maximum model length" of vLLM's refusal: its binary search over [1, max_model_len]
    against the available memory minus the null block (`_estimate_max_model_len_from_groups`); 0 if not
    even one token fits (vLLM then omits the sentence)."""
    check_memory = available_bytes - layout.bytes_per_block

    def fits(model_len: int) -> bool:
        return blocks_per_request(model_len, layout.block_size) * layout.bytes_per_block <= check_memory

    left, right = 1, max_model_len
    if not fits(left):
        return 0
    result = 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result = mid
            left = mid + 1
        else:
            right = mid - 1
    return result


def largest_max_model_len(available_bytes: int, layout: KVLayout) -> int:
    """The largest max_model_len for which one request fits (no upper cap): whole usable blocks."""
    check_memory = available_bytes - layout.bytes_per_block
    if check_memory <= 0:
        return 0
    return (check_memory // layout.bytes_per_block) * layout.block_size


@dataclass(frozen=True)
class FrontierPoint:
    """A (max_model_len, max_num_seqs) pair: that many requests at full length fit at once."""

    max_model_len: int
    max_num_seqs: int


def frontier(num_blocks: int, block_size: int, cap: int | None) -> tuple[FrontierPoint, ...]:
    """Pairs (length, seqs) along the KV limit: usable blocks (all but the null block) // blocks per
    request, for lengths doubling from 512 (or one block) up to the largest that fits one request."""
    usable = num_blocks - 1
    if usable < 1:
        return ()
    longest = usable * block_size if cap is None else min(cap, usable * block_size)
    lengths: list[int] = []
    length = max(block_size, 512)
    while length < longest:
        lengths.append(length)
        length *= 2
    lengths.append(longest)
    return tuple(
        FrontierPoint(n, usable // blocks_per_request(n, block_size))
        for n in lengths
        if usable // blocks_per_request(n, block_size) >= 1
    )
