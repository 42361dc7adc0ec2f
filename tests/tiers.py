"""The quick tier, ``python -m pytest -q -m "not slow" --hypothesis-profile=quick``:
the tests `SLOW` names (node-id prefixes: a whole module, a test, or some of its cases;
the ones that launch ranks or a subprocess, and the heaviest of the rest) are marked
``slow`` and left out, but those `QUICK` names, so that each test module still runs at least once:
its other tests, or one launch of real ranks or one subprocess where that is all it has.
tests/conftest.py marks them; tests/test_suite_settings.py checks that every module keeps
a quick test and that every name here exists."""

from __future__ import annotations

# Modules whose tests launch real ranks or a subprocess each.
_SLOW_MODULES = (
    "test_accumulator_distributed",
    "test_batchstep_distributed",
    "test_cross_distributed",
    "test_distributed",
    "test_edges_distributed",
    "test_elastic_distributed",
    "test_reliability_distributed",
    "test_resuming_distributed",
    "test_testing_distributed",
)

SLOW: tuple[str, ...] = (
    *(f"tests/{module}.py::" for module in _SLOW_MODULES),
    "tests/test_state_machine.py::TestChunk",  # but its first: 30 sequences
    "tests/test_accumulator.py::TestItemNormalizationInFloat16::test_a_window_of_80000_items_in_float16",
    # (the item-mode cases of each point; the distributed module holds them at every point too)
    "tests/test_batchstep.py::TestOutOfMemory::test_a_window_re_runs_smaller_into_the_small_microbatch_run[first-forward-items]",
    "tests/test_batchstep.py::TestOutOfMemory::test_a_window_re_runs_smaller_into_the_small_microbatch_run[first-backward-items]",
    "tests/test_batchstep.py::TestOutOfMemory::test_a_window_re_runs_smaller_into_the_small_microbatch_run[middle-forward-items]",
    "tests/test_batchstep.py::TestOutOfMemory::test_a_window_re_runs_smaller_into_the_small_microbatch_run[middle-backward-items]",
    "tests/test_batchstep.py::TestOutOfMemory::test_a_window_re_runs_smaller_into_the_small_microbatch_run[last-forward-items]",
    "tests/test_batchstep.py::TestOutOfMemory::test_a_window_re_runs_smaller_into_the_small_microbatch_run[last-backward-items]",
    "tests/test_benchmark_gpu.py::test_a_failing_row_is_reported_and_the_next_runs",
    "tests/test_cli.py::test_help_from_the_command_line",
    "tests/test_docs.py::test_api_page_shows_step_fields_not_its_constructor",  # mkdocs build
    "tests/test_docs.py::test_code_blocks_run[checkpoint.md]",
    "tests/test_docs.py::test_code_blocks_run[distributed.md]",
    "tests/test_docs.py::test_code_blocks_run[testing.md]",
    "tests/test_edges.py::test_a_compiled_training_step",
    "tests/test_memory.py::test_a_real_allocation_failure_re_runs_the_window_at_half",
    "tests/test_epoch.py::test_boundaries_are_announced_before_each_forward",
    "tests/test_examples_accelerate.py::test_the_prepared_loop_is_exact_and_steps_its_schedule_once_per_window[2]",
    "tests/test_examples_accelerate.py::test_the_checkpoint_recipe_resumes_a_prepared_loader_bit_for_bit[2]",
    "tests/test_examples_muon.py::test_it_is_bit_for_bit_the_hand_written_loop[1]",
    "tests/test_foreign.py::test_a_scheduler_built_before_fabric_s_setup_steps_the_optimizer_it_wraps",
    "tests/test_examples_muon.py::test_it_is_bit_for_bit_the_hand_written_loop[4]",
    "tests/test_examples_tiny_lm.py::test_tiny_lm_matches_the_big_batch_with_num_items",
    "tests/test_examples_own_trainer.py::test_its_loop_all_reduces_once_per_window_under_ddp",
    "tests/test_examples_own_trainer.py::test_the_script_logs_every_quarter_epoch",
    "tests/test_examples_own_trainer.py::test_the_script_runs_on_two_ranks",
    "tests/test_fsdp_tp.py::test_fsdp_on_the_dp_dim_of_a_tp_mesh_is_detected_as_such",
    "tests/test_fsdp_tp.py::test_plain_hsdp_and_fully_shard_are_still_classified_as_before",
    "tests/test_fsdp_tp.py::test_every_policy_matches_the_big_batch_reference",
    "tests/test_fsdp_tp.py::test_items_are_summed_over_the_data_parallel_ranks_only",
    "tests/test_fsdp_tp.py::test_two_optimizers_match_the_reference_with_one_clip_of_the_whole_norm",
    "tests/test_hooks.py::test_the_habits_around_the_loop_work_under_every_wrapping",
    "tests/test_hooks.py::test_a_compiled_ddp_model_compiles_once_whatever_the_accumulators",
    "tests/test_hooks.py::test_ddp_bucket_views_rebuilt_after_the_first_backward_are_no_wipe",
    "tests/test_hooks.py::test_a_plain_model_compiled_with_fullgraph_on_several_ranks_trains",
    "tests/test_numerics.py::test_num_items_equals_item_mean_over_the_window",
    "tests/test_plan.py::TestEpochPlanCut::test_sized_epoch_matches_the_brute_force_cut",
    "tests/test_public_api.py::test_import_gradaccum_leaves_testing_and_hypothesis_out",
    "tests/test_resuming.py::test_the_resume_example_resumes_in_another_process",
    "tests/test_resuming.py::test_resume_at_every_window_boundary_is_bit_for_bit",
    "tests/test_resuming.py::TestPersistentWorkers::",
    "tests/test_suite_settings.py::test_a_time_limit_that_fires_says_the_machine_was_too_slow",
    "tests/test_sync.py::test_compile_wrappers_are_seen_through",
    "tests/test_testing_equivalence.py::test_adam_s_step_of_a_rounding_level_gradient_is_no_false_alarm",
    "tests/test_testing_equivalence.py::test_a_model_that_is_not_per_item_is_named_as_the_cause",
    "tests/test_testing_example.py::test_the_example_test_fails_on_the_trainer_as_written",
    "tests/test_testing_example.py::test_the_hugging_face_trainer_is_judged_as_its_users_run_it",
    "tests/test_testing_ranks.py::test_a_hang_is_killed_and_reported_with_the_waiting_rank_s_timeout",
    "tests/test_testing_strategies.py::test_without_hypothesis_the_import_names_the_testing_extra",
    "tests/test_verify.py::test_verify_passes_and_prints_json",
    "tests/test_verify.py::test_verify_table_fits_100_columns_and_ends_in_the_verdict",
    "tests/test_verify.py::test_verify_catches_arming_after_the_forward",
    "tests/test_verify.py::test_a_usage_error_from_the_command_line_has_no_traceback",
)

# The one test (or chunk) of each module above that the quick tier keeps.
QUICK: tuple[str, ...] = (
    "tests/test_state_machine.py::TestChunk0::",
    "tests/test_accumulator_distributed.py::test_zero_grad_in_a_window_is_each_ranks_own_refusal_under_ddp",
    "tests/test_batchstep_distributed.py::test_auto_is_refused_where_a_forward_communicates",
    "tests/test_cross_distributed.py::test_the_reference_cuts_windows_as_documented",
    "tests/test_distributed.py::test_no_sync_keeps_the_gradient_local",
    "tests/test_edges_distributed.py::test_two_forwards_in_one_microstep_under_ddp",
    "tests/test_elastic_distributed.py::test_a_checkpoint_at_an_epochs_end_resumes_on_another_number_of_ranks",
    "tests/test_reliability_distributed.py::test_forward_run_for_another_microstep_warns",
    "tests/test_resuming_distributed.py::test_another_world_size_is_refused",
    "tests/test_testing_distributed.py::test_a_zero_grad_inside_the_window_is_named_on_every_rank",
)
