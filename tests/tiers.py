"""The slow tier of the test suite.

``python -m pytest tests -q -m "not slow"`` is the quick check: the API, the reference, the
modules and integrations, and every parametrized kernel test on at least one case, in a few
minutes on 2 CPU cores.
``python -m pytest tests -q`` (what CI runs) adds the slow tier below.

``SLOW[module][function]`` is ``"all"`` (every case of the test is slow) or ``"rest"`` (the
first collected case stays in the quick check, the others are slow). Tests are put here by
measured time on a 2-core CPU machine: whole tests that take more than about 2 s, and the
further cases of parametrized ones. ``conftest.py`` marks them ``slow`` at collection and,
after a run, names the quick tests that took longer than ``QUICK_LIMIT_S`` (a module's first test
may also carry its module fixtures: worker processes, a built wheel).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable

import pytest

QUICK_LIMIT_S = 10.0

SLOW: Dict[str, Dict[str, str]] = {
    "test_backward_plan.py": {
        "test_eager_autograd_hands_the_plan_over_and_the_op_path_still_plans": "all",
        "test_handed_over_plan_gives_the_same_gradients": "all",
    },
    "test_benchmarks_smoke.py": {
        "test_profile_tables": "all",
        "test_quick_benchmark_writes_reports": "all",
        "test_quick_dma_long_benchmark": "all",
        "test_quick_varlen_benchmark": "all",
    },
    "test_cli.py": {
        "test_demo_under_the_triton_interpreter_finishes_in_seconds": "all",
    },
    "test_compile.py": {
        "test_inductor_compile_matches_eager": "all",
    },
    "test_compile_gpu_target.py": {
        "test_kernels_compile_for_sm90": "all",
    },
    "test_context_parallel.py": {
        "test_cp_benchmark_quick": "all",
        "test_example_under_torchrun": "all",
    },
    "test_cuda_dropout_lanes.py": {
        "test_kernels_accumulator_layout_is_the_helpers": "all",
    },
    "test_cuda_jit.py": {
        "test_cli_info_and_build_all_without_cuda": "all",
    },
    "test_decode.py": {
        "test_decode_kernel_shapes": "rest",
    },
    "test_doge_generate_probe.py": {
        "test_tiny_probe_runs_and_reports": "all",
    },
    "test_examples.py": {
        "test_loss_decreases_on_a_tiny_problem": "rest",
        "test_smoke_cli_writes_reports": "all",
    },
    "test_flex.py": {
        "test_multi_tile_cases": "all",
        "test_random_cases": "all",
    },
    "test_fuzz_backends.py": {
        "test_interpreted_triton_answers_or_declines": "all",
    },
    "test_key_intervals.py": {
        "test_flex_matches_dense": "rest",
    },
    "test_key_mask_lists.py": {
        "test_mixed_tiles_forward_and_backward": "all",
        "test_plain_rows_split_is_exact": "all",
    },
    "test_mask_summary.py": {
        "test_causal_summary_skips_only_invisible_tiles": "all",
        "test_derived_tile_maps_equal_direct_ones": "all",
        "test_flex_tile_maps_from_summary_equal_torch_reductions": "all",
        "test_gather_bits_from_key_bits_equal_bits_from_the_mask": "all",
        "test_gather_plan_auto_policy_is_decided_on_totals": "all",
        "test_gather_plan_gathers_a_per_key_bias": "rest",
        "test_gather_plan_kernel_matches_torch": "all",
        "test_gather_plan_kernels_match_torch_reference": "all",
        "test_key_bits_hold_each_live_visible_element_once": "all",
        "test_summary_matches_block_reductions": "rest",
        "test_tile_lists_and_gather_plan_identical_with_summary": "all",
    },
    "test_paged.py": {
        "test_decode_paged_shapes": "rest",
    },
    "test_topk_intervals.py": {
        "test_intervals_match_dense_helpers": "all",
        "test_kernels_every_radix_and_small_blocks": "all",
        "test_kernels_match_plain_path": "rest",
        "test_kernels_match_plain_path_random": "all",
        "test_million_keys_without_quadratic_memory": "all",
    },
    "test_triton_backend.py": {
        "test_deterministic_backward_is_bitwise_reproducible": "all",
        "test_public_api_outputs_and_grads": "all",
    },
    "test_triton_intervals.py": {
        "test_intervals_match_dense": "rest",
        "test_random_interval_problems": "all",
    },
    "test_triton_kernels.py": {
        "test_bias_broadcast": "rest",
        "test_bias_broadcast_mha": "rest",
        "test_deterministic_bitwise": "rest",
        "test_empty_rows_no_nan": "all",
        "test_gather_mode_causal_call_hides_what_the_mask_keeps": "rest",
        "test_gather_mode_low_precision": "rest",
        "test_gather_mode_matches_naive": "all",
        "test_gather_plan_auto_prefers_gather_only_when_it_saves_work": "all",
        "test_geometries_plain": "rest",
        "test_lagged_gather_decision_keeps_outputs_exact": "all",
        "test_lagged_gather_plan_follows_the_previous_call_of_its_shape": "all",
        "test_lagged_gather_plans_count_tiles_every_few_calls": "all",
        "test_low_precision": "rest",
        "test_mask_and_bias_softcap": "rest",
        "test_mask_broadcast": "rest",
        "test_mixed_dead_full_partial_tiles": "all",
    },
    "test_triton_varlen.py": {
        "test_varlen_deterministic_bitwise": "all",
        "test_varlen_key_tiles_dead_full_partial": "all",
        "test_varlen_matches_reference": "rest",
    },
}


def mark_slow(items: Iterable[pytest.Item]) -> None:
    """Add the ``slow`` marker to the collected items that :data:`SLOW` puts in the tier."""
    seen = defaultdict(int)
    for item in items:
        module = Path(str(item.fspath)).name
        function = getattr(item, "originalname", None) or item.name.split("[")[0]
        kind = SLOW.get(module, {}).get(function)
        if kind is None:
            continue
        seen[(module, function)] += 1
        if kind == "all" or seen[(module, function)] > 1:
            item.add_marker(pytest.mark.slow)
