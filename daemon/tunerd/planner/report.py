"""The plan for people and for scripts: `render_plan_table` (the `tunerd plan` table) and `plan_to_json`
(`tunerd plan --json`). Pure: both return data, the caller prints.
"""

from __future__ import annotations

from typing import Any

from tunerd.core.units import bytes_text
from tunerd.planner.plan import PlanVerdict


def _tokens_cell(plan: PlanVerdict) -> str:
    """The predicted token count, with its range when the budget is not exact."""
    if plan.kv_cache_tokens is None:
        return "-"
    low_high = plan.kv_cache_tokens_range
    if low_high and low_high[0] != low_high[1]:
        return f"{plan.kv_cache_tokens:,} (range {low_high[0]:,}–{low_high[1]:,})"
    return f"{plan.kv_cache_tokens:,}"


def render_plan_table(plan: PlanVerdict) -> str:
    """The plan as a readable two-column table, then the reasons and the suggested flags."""
    b = plan.budget
    verdict = "FEASIBLE" if plan.feasible else "NOT FEASIBLE"
    rows: list[tuple[str, str]] = [
        ("verdict", f"{verdict} — band {plan.band}" + (" (forced)" if plan.forced else "")),
        ("oversubscription ratio", "-" if plan.ratio is None else f"{plan.ratio:.3f}"),
        ("model", plan.model),
        ("backend / memory", f"{plan.backend} / {plan.memory_kind}"),
        ("weights", f"{bytes_text(plan.weights_bytes)} — {plan.weights_source}"),
        ("KV dtype / block size", f"{plan.kv_cache_dtype} / {plan.block_size}"),
        ("KV bytes per token", "-" if plan.kv_bytes_per_token is None else f"{plan.kv_bytes_per_token:,}"),
        ("KV bytes per block", "-" if plan.bytes_per_block is None else f"{plan.bytes_per_block:,}"),
        ("memory total (× util)", bytes_text(b.total_bytes)),
        ("requested (ceil(total × util))", bytes_text(b.requested_bytes)),
        ("non-KV memory", f"{bytes_text(b.non_kv_bytes)} — {b.non_kv_source}"),
        ("KV budget", f"{bytes_text(b.kv_bytes)} — {b.source}"),
        ("physically available", f"{bytes_text(b.physical_bytes)} — {b.physical_source}"),
        ("KV blocks", "-" if plan.num_blocks is None else f"{plan.num_blocks:,}"),
        ("KV cache tokens", _tokens_cell(plan)),
        (
            f"max concurrency at {plan.max_model_len:,} tokens",
            "-" if plan.max_concurrency is None else f"{plan.max_concurrency:.2f}x",
        ),
        (
            "largest max_model_len (1 request)",
            "-" if plan.largest_max_model_len is None else f"{plan.largest_max_model_len:,}",
        ),
    ]
    if plan.vllm_estimated_max_model_len is not None:
        rows.append(("vLLM would refuse; its estimate", f"{plan.vllm_estimated_max_model_len:,}"))
    if plan.frontier:
        rows.append(
            (
                "frontier (len → seqs)",
                ", ".join(f"{p.max_model_len:,}→{p.max_num_seqs:,}" for p in plan.frontier),
            )
        )
    width = max(len(k) for k, _ in rows)
    out = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if plan.reasons:
        out.append("")
        out.extend(f"- {r}" for r in plan.reasons)
    if plan.suggested is not None:
        out.append("")
        out.append("suggested flags: " + " ".join(plan.suggested.to_argv()))
    return "\n".join(out)


def plan_to_json(plan: PlanVerdict) -> dict[str, Any]:
    """The plan as plain JSON-serialisable data (`tunerd plan --json`)."""
    b = plan.budget
    return {
        "feasible": plan.feasible,
        "band": plan.band,
        "ratio": plan.ratio,
        "forced": plan.forced,
        "backend": plan.backend,
        "memory_kind": plan.memory_kind,
        "model": plan.model,
        "params": plan.params.as_dict(),
        "max_model_len": plan.max_model_len,
        "max_num_seqs": plan.max_num_seqs,
        "block_size": plan.block_size,
        "kv_cache_dtype": plan.kv_cache_dtype,
        "weights_bytes": plan.weights_bytes,
        "weights_source": plan.weights_source,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "bytes_per_block": plan.bytes_per_block,
        "budget": {
            "kind": b.kind,
            "kv_bytes": b.kv_bytes,
            "kv_bytes_range": [b.kv_bytes_low, b.kv_bytes_high],
            "source": b.source,
            "total_bytes": b.total_bytes,
            "requested_bytes": b.requested_bytes,
            "non_kv_bytes": b.non_kv_bytes,
            "non_kv_source": b.non_kv_source,
            "physical_bytes": b.physical_bytes,
            "physical_source": b.physical_source,
            "start_refusals": list(b.start_refusals),
        },
        "reserve_bytes": plan.reserve_bytes,
        "kv_demand_bytes": plan.kv_demand_bytes,
        "num_blocks": plan.num_blocks,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "kv_cache_tokens_range": None
        if plan.kv_cache_tokens_range is None
        else list(plan.kv_cache_tokens_range),
        "max_concurrency": plan.max_concurrency,
        "largest_max_model_len": plan.largest_max_model_len,
        "vllm_estimated_max_model_len": plan.vllm_estimated_max_model_len,
        "frontier": [[p.max_model_len, p.max_num_seqs] for p in plan.frontier],
        "calibrated": plan.calibrated,
        "kv_unavailable": plan.kv_unavailable,
        "reasons": list(plan.reasons),
        "suggested_params": None if plan.suggested is None else plan.suggested.as_dict(),
        "suggested_argv": None if plan.suggested is None else plan.suggested.to_argv(),
    }
