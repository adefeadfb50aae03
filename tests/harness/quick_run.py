"""The quick run's skip list (read by tests/conftest.py; checked by tests/test_quick_run.py)."""

import re

# Left to the thorough run as well (beside the tests marked thorough): the quick run's slowest tests that repeat
# what a cheaper one of the same family checks (another tp, depth or dtype of a parametrized test), or that spawn
# gloo processes or the Triton interpreter. Measured on a fresh clone, 2 cores, cold cache, 2026-12-02: the quick
# run took 9.5 min with these; 6.4 min without them (under load), then the next five were left out too.
# A node id matches an entry by prefix; ``*`` in an entry stands for any text (fnmatch would read the ``[`` of a
# parametrized id as a character class).
# Measured on 2026-12-03 (fresh clone, 2 cores, empty Inductor cache): 6.7 min with the entries up to here, so the
# parametrized duplicates below were left out too (one case of each family stays).
QUICK_RUN_SKIPS = (
    "tests/test_kernels.py::test_triton_kernels_under_interpreter",  # 78 s; test_kernels' torch twins stay
    "tests/test_sp_rewrite.py::test_generated_code_of_the_sharded_graph_matches_sp_off[Case(tp=3",  # tp=2 stays
    "tests/test_one_trace.py::test_one_trace_gives_each_rank_the_graph_of_its_own_capture[hc_decoder-3",
    "tests/test_one_trace.py::test_uneven_shards_are_refused_then_captured_per_rank",
    "tests/real_models/test_compile.py::test_hcpasses_backend_matches_eager[deepseek_v4-2]",  # 1 layer stays
    "tests/real_models/test_compile.py::test_hcpasses_backend_matches_eager[qwen4_exp-2]",
    "tests/real_models/test_compile.py::test_qwen4_exp_breaks_only_in_the_qsa_indexer",
    "tests/real_models/test_compile.py::test_qwen4_exp_delta_rule_loop_is_not_counted_as_hc_blocks",
    "tests/real_models/test_sp_real.py::test_sp_shards_every_hc_block_and_matches_one_device[deepseek_v4",
    "tests/test_report_cache.py::test_each_variant_gets_its_own_report_from_a_shared_cache",
    "tests/test_grad_mode.py::test_cache_hits_get_the_report_of_their_own_mode",
    "tests/test_harness.py::test_hc_decoder_tp2_simulated_matches_gloo",
    "tests/test_harness.py::test_simulator_matches_gloo[mlp-3]",  # tp 2 stays
    "tests/test_mtp_sp.py::test_fused_target_and_drafter_keep_the_state_sharded[3-",  # tp 2 stays
    "tests/test_gated_mean_quant.py::test_every_hc_followed_by_a_quant_fuses_in_the_fp8_model[dtype1]",
    "tests/test_models.py::test_tp_matches_tp1[tp3",  # tp 2 stays
    "tests/test_bench_models.py::test_handwritten_sp_matches_tp1[tp3",
    "tests/test_sp_e2e.py::test_cudagraphs_only_for_unsharded_graphs",
    "tests/test_grad_mode.py::test_grad_mode_graph_is_skipped_with_the_reason",  # 38 s; the no_grad case stays
    "tests/test_harness.py::test_simulator_matches_gloo[sp-3]",
    "tests/test_bench_models.py::test_handwritten_sp_collectives[tp3",
    # with these two, no quick-run test needs the tp 3 ranks fixture (3 gloo processes, about 12 s); at tp 2,
    # T = 1 leaves a rank only padding too
    "tests/test_bench_models.py::test_row_shards_slice_then_pad[tp3",
    "tests/test_bench_models.py::test_mhc_tp2_matches_tp1[tp3",  # skipped at tp 3 anyway, after its fixture ran
    "tests/real_models/test_fp8_swap.py::test_quant_constants_are_graph_literals[deepseek_v4]",
    "tests/test_corpus_sp.py::test_delta_rule_solve_steps_are_not_hc_blocks[torch.bfloat16]",
    "tests/test_corpus_sp.py::test_every_norm_spelling_shards_every_block[*-torch.bfloat16-3]",  # [*-float32-1] stays
    "tests/test_corpus_sp.py::test_every_norm_spelling_shards_every_block[*-None-torch.float32-9]",
    "tests/real_models/test_compile.py::test_hcpasses_backend_matches_eager[deepseek_v4-1]",  # 27 s; qwen4_exp stays
    "tests/test_quick_run.py::test_every_quick_run_skip_names_a_collected_test",  # guards this list: CI runs it
    "tests/test_corpus_fusion.py::test_every_identical_quant_spelling_fuses_every_block[*-torch.bfloat16]",
    "tests/test_gated_mean_quant.py::test_flag_and_env_turn_the_fusion_off",  # test_promises checks every flag and env
    "tests/test_grad_mode.py::test_inference_compile_is_rewritten[inference_mode]",  # no_grad stays
    "tests/test_harness.py::test_simulator_matches_gloo[mlp-2]",  # sp-2 stays
    "tests/test_bench_models.py::test_bench_handwritten_sp_matches_plain[tp3",  # the last user of the tp 3 ranks
    # qwen4_exp's SP as Dynamo traces GatedDeltaNet on CPU; the case with the delta rule as one op stays
    "tests/real_models/test_sp_real.py::test_sp_shards_every_hc_block_and_matches_one_device[qwen4_exp-True-2-False]",
    "tests/test_corpus_fusion.py::test_every_weighted_sum_spelling_fuses_with_its_quant[*-torch.bfloat16]",
    # 4:54 with the entries up to here (2026-12-03); the tp 2 cases that start gloo processes (the simulator-based
    # tests check the same rewrites in process, as for the tests marked thorough) go too
    "tests/test_models.py::test_tp_matches_tp1[tp2",
    "tests/test_bench_models.py::test_handwritten_sp_matches_tp1[tp2",
    "tests/test_bench_models.py::test_handwritten_sp_collectives[tp2",
    "tests/test_bench_models.py::test_row_shards_slice_then_pad[tp2",
    "tests/test_bench_models.py::test_mhc_tp2_matches_tp1[tp2",
    "tests/test_bench_models.py::test_bench_handwritten_sp_matches_plain[tp2",
    "tests/test_harness.py::test_simulator_matches_gloo[sp-2]",
    # 7.0 min on 2026-12-07 (the machine idle, 779 run): another tp, T, dtype or a symbolic count of a check a cheaper
    # case makes; one case of each family stays (named after it)
    "tests/test_sp_kept_rows.py::test_only_the_kept_rows_are_gathered_after_a_final_norm_on_the_shards[14-4-3]",
    "tests/test_sp_kept_rows.py::test_only_the_kept_rows_are_gathered_after_a_final_norm_on_the_shards[7-4-1]",
    "tests/test_sp_kept_rows.py::test_only_the_kept_rows_are_gathered_after_a_final_norm_on_the_shards[9-4-1]",
    # [16-2-1] (one row: slices) and [9-3-2] (two rows: an index) stay
    "tests/test_sp_kept_rows.py::test_a_select_of_the_last_row_or_rows_before_it_are_gathered_alone[True-before_last-2]",
    "tests/test_sp_kept_rows.py::test_a_select_of_the_last_row_or_rows_before_it_are_gathered_alone[True-select_before",
    "tests/test_sp_kept_rows.py::test_a_slice_that_would_not_gather_fewer_rows_keeps_the_full_gather_and_says_why[12-",
    "tests/test_sp_prologue.py::test_a_norm_before_bf16_gemms_runs_on_the_shards_and_its_bf16_result_is_gathered[16-8]",
    "tests/test_sp_prologue.py::test_a_norm_before_bf16_gemms_runs_on_the_shards_and_its_bf16_result_is_gathered[7-4]",
    "tests/test_sp_prologue.py::test_a_norm_before_bf16_gemms_runs_on_the_shards_and_its_bf16_result_is_gathered[12-3]",
    "tests/test_sp_windows.py::test_a_causal_conv_over_the_tokens_runs_on_each_ranks_rows_and_the_rows_before[7-4]",
    "tests/test_sp_windows.py::test_a_causal_conv_over_the_tokens_runs_on_each_ranks_rows_and_the_rows_before[2-4]",
    "tests/real_models/test_sp_real.py::test_qwen4_exp_ple_runs_on_the_shards[16]",  # [13] (ragged) stays
    "tests/real_models/test_sp_real.py::test_logits_to_keep_gathers_only_the_last_row_of_each_sequence[deepseek_v4",
    "tests/test_lazy_variants.py::test_the_unsharded_variant_is_compiled_on_the_first_small_call_and_serves_every_small_t[True]",
    "tests/test_sp_region.py::test_a_symbolic_count_feeds_a_token_window_only_where_every_rank_holds_as_many_rows[16-",
    "tests/test_corpus_sp.py::test_every_norm_spelling_shards_every_block[F.rms_norm-1-torch.float32-1]",
    "tests/test_simulated_tp.py::test_a_symbolic_token_count_compiles_once_for_even_and_ragged_counts[1]",
    "tests/test_corpus_fusion.py::test_every_near_miss_is_left_unfused_and_named[*-torch.bfloat16]",
    "tests/test_sp_kept_rows.py::test_a_select_of_the_last_row_or_rows_before_it_are_gathered_alone[True-select-1]",
    # 5.8 min with the entries up to here: the benchmark scripts' CPU runs go too (as prefill_hf's, marked thorough)
    "tests/test_blocked_scans.py::test_the_benchmark_runs_on_cpu_and_records_each_variant",
    "tests/test_delta_rule_host.py::test_the_cpu_smoke_run_times_the_torch_levels_and_names_the_fla_levels_left_out",
    "tests/test_generate_hf_smoke.py::test_an_unknown_variant_is_refused_naming_the_valid_ones",
)


def _pattern(entry: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in entry.split("*")))


_PATTERNS = tuple(_pattern(entry) for entry in QUICK_RUN_SKIPS)


def skipped_in_quick_run(nodeid: str) -> bool:
    """Whether an entry of :data:`QUICK_RUN_SKIPS` matches the start of ``nodeid``."""
    return any(pattern.match(nodeid) for pattern in _PATTERNS)


def stale_entries(nodeids: list[str]) -> list[str]:
    """The entries that match none of ``nodeids``."""
    return [
        entry for entry, pattern in zip(QUICK_RUN_SKIPS, _PATTERNS, strict=True) if not any(map(pattern.match, nodeids))
    ]
