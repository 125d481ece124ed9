"""Test-wide settings: the ``slow`` marker and which tests carry it.

    python -m pytest -q                  # everything (the README's and CI's command)
    python -m pytest -q -m "not slow"    # the inner loop: under 4 minutes on two cores

Shared helpers live in plain support modules beside the tests (``search_helpers``,
``spec_helpers``, ``runtime_helpers``, ``runtime_plans``); no test module imports another.

The slow tests are named here, not in their modules, so the tier is one list to read and to
re-measure (``python -m pytest -q --durations=0 -p no:cacheprovider``). A key is a module
(``test_x.py``), a test function (``test_x.py::test_f``, all its parameters) or one
parametrized case (``test_x.py::test_f[id]``); its value is what it took, in seconds, on the
two-core development machine. A key that names nothing collected is a warning (a renamed test
would silently join the fast tier).
"""

from __future__ import annotations

import warnings

import pytest

# Measured on the tree of 2b9bfa0 (1142 tests, 2242 s in all while the machine ran other work
# too); every function of 3 s or more (all its cases together) is here, the rest took 100 s.
# The fast tier then ran in 4 min 12 s (load average 4-6 on two cores) before the last entry.
SLOW: dict[str, int] = {
    # the planner's promise through the CLI: a few hundred random requests (measured alone)
    "test_plan_property.py": 480,
    # launching a schema-1 plan under torchrun (measured in the fast tier's own run, 897ed52)
    "test_plan_schema.py::test_a_schema_1_plan_launches": 32,
    # elastic training: replans and launches that lose a rank (measured alone, 2026-12-02)
    "test_elastic.py::test_elastic_run_survives_a_killed_rank_and_matches_a_resume_under_the_new_plan": 75,
    "test_elastic.py::test_too_few_ranks_left_stops_with_one_line_and_keeps_the_checkpoint": 30,
    "test_elastic.py::test_replan_llama_3_70b_from_four_nodes_to_three": 15,
    "test_elastic.py::test_replan_refuses_its_own_input_and_a_cluster_too_small": 10,
    "test_elastic.py::test_replan_keeps_the_model_and_batch_and_says_what_moves": 8,
    "test_elastic.py::test_elastic_needs_a_checkpoint_dir": 6,
    "test_export.py::test_an_export_that_does_not_fit_exits_3_and_writes_nothing": 30,
    # runs that fail: a full checkpoint disk, a full metrics disk, a killed rank (measured alone, 2026-12-02)
    "test_rank_failures.py::test_a_checkpoint_that_fills_the_disk_is_one_line_and_the_older_step_is_kept": 65,
    "test_rank_failures.py::test_a_disk_that_fills_mid_run_under_metrics_is_one_line": 41,
    "test_rank_failures.py::test_a_killed_rank_is_one_line_naming_it_its_signal_and_its_log": 36,
    # Hugging Face weights and token files through the runtime (measured beside a full run, 2026-12-02)
    "test_hf_weights.py::test_loaded_under_tp_fsdp_and_pp_it_trains_as_one_process_from_the_folder": 120,
    "test_hf_weights.py::test_a_checkpoint_exports_as_a_folder_that_reads_back_bit_for_bit": 30,
    "test_hf_weights.py::test_the_readme_loop_tokenize_launch_from_weights_and_export": 95,
    "test_tokens.py::test_training_on_token_files_learns_and_a_resume_reproduces_the_losses": 20,
    "test_engine_fit.py": 16,
    # test_runtime_launch.py
    "test_runtime_launch.py::test_launch_runs_ranks_under_torchrun": 127,
    "test_runtime_launch.py::test_launch_draws_the_run_measured_against_predicted_per_stage": 61,
    "test_runtime_launch.py::test_ctrl_c_stops_every_rank_with_one_line": 43,
    "test_runtime_launch.py::test_a_plan_on_part_of_a_cluster_launches": 35,
    "test_runtime_launch.py::test_kill_and_resume_reproduces_the_uninterrupted_losses": 33,
    "test_runtime_launch.py::test_resume_under_another_plan_reshards_the_checkpoint": 22,
    "test_runtime_launch.py::test_resume_is_checked_against_the_checkpoint_before_any_rank_starts": 10,
    "test_runtime_launch.py::test_worker_destroys_its_process_groups_before_python_exits": 7,
    # test_runtime_memory.py
    "test_runtime_memory.py::test_each_ranks_tracked_memory_is_the_plans_prediction": 326,
    "test_runtime_memory.py::test_a_tied_heads_copy_is_priced": 7,
    # test_search_exact.py
    "test_search_exact.py::test_same_input_same_plan_on_a_loaded_machine": 153,
    "test_search_exact.py::test_cpsat_searches_when_the_uniform_grid_finds_nothing": 78,
    "test_search_exact.py::test_a_requested_gap_bounds_the_plan_returned": 29,
    "test_search_exact.py::test_a_shapes_bound_before_its_tables_is_the_bound_its_tables_give": 5,
    # test_json_cost.py
    "test_json_cost.py::test_cost_objective_picks_the_cheapest_plan_per_token_which_is_not_the_fastest": 92,
    "test_json_cost.py::test_top_k_lists_different_shapes_best_first": 45,
    "test_json_cost.py::test_every_command_prints_schema_valid_json": 8,
    "test_json_cost.py::test_cluster_yaml_overrides_prices_without_changing_the_cluster": 7,
    "test_json_cost.py::test_export_pricing_json_and_top_k_need_no_torch": 7,
    # test_search.py
    "test_search.py::test_cpsat_matches_brute_force_oracle_on_one_group": 113,
    "test_search.py::test_large_models_memory_is_judged_right_by_cp_sat": 15,
    "test_search.py::test_same_seed_same_plan": 10,
    "test_search.py::test_profiles_of_several_device_types_combine": 5,
    "test_search.py::test_plan_validates_and_is_never_worse_than_uniform": 5,
    # test_runtime_parallel.py
    "test_runtime_parallel.py::test_plan_trains_like_one_process": 106,
    "test_runtime_parallel.py::test_mixed_precision_tracks_fp32": 11,
    "test_runtime_parallel.py::test_interleaved_pipeline_trains_like_one_process": 10,
    "test_runtime_parallel.py::test_gqa_with_qkv_bias_under_tp": 4,
    "test_runtime_parallel.py::test_tied_embeddings_across_stages_train_like_one_process": 3,
    # test_runtime_boundary.py
    "test_runtime_boundary.py::test_a_boundary_carries_the_priced_shards_and_trains_like_one_process": 126,
    # test_replicas.py
    "test_replicas.py::test_mixtures_of_experts_keep_one_device_type_per_stage": 36,
    "test_replicas.py::test_fast_replicas_take_larger_shares_and_use_every_gpu": 18,
    "test_replicas.py::test_replicas_on_two_groups_train_like_one_process": 17,
    "test_replicas.py::test_the_throughput_bound_holds_for_plans_on_the_cluster": 13,
    "test_replicas.py::test_a_mixed_replica_plan_prints_schema_valid_json": 4,
    # test_profiler.py
    "test_profiler.py::test_every_kind_width_and_micro_batch_is_measured": 61,
    "test_profiler.py::test_activation_memory_matches_the_analytic_model": 8,
    "test_profiler.py::test_a_plan_from_the_measured_profile_validates": 4,
    "test_profiler.py::test_bad_input_is_one_line_exit_2": 3,
    # test_runtime_shares.py
    "test_runtime_shares.py::test_uneven_shares_train_like_one_process": 58,
    # test_parsers_fuzz.py
    "test_parsers_fuzz.py::test_parse_yaml_deep_nesting": 13,
    "test_parsers_fuzz.py::test_parse_short": 9,
    "test_parsers_fuzz.py::test_parse_yaml_text": 5,
    "test_parsers_fuzz.py::test_plan_from_dict": 5,
    "test_parsers_fuzz.py::test_cluster_from_dict": 5,
    "test_parsers_fuzz.py::test_spec_from_hf": 5,
    "test_parsers_fuzz.py::test_profile_from_dict": 4,
    # test_report.py
    "test_report.py::test_timeline_has_a_box_per_action_and_every_stage": 17,
    "test_report.py::test_without_torch_1f1b_draws_and_interleaved_says_why": 13,
    "test_report.py::test_report_is_one_file_with_the_plan_the_bars_and_the_pictures": 9,
    "test_report.py::test_timeline_png": 5,
    # test_runtime_schedules.py
    "test_runtime_schedules.py::test_zero_bubble_schedule_trains_like_one_process": 24,
    "test_runtime_schedules.py::test_zero_bubble_memory_is_measured_near_the_prediction": 9,
    "test_runtime_schedules.py::test_the_runtime_holds_the_micro_batches_the_plan_prices": 4,
    "test_runtime_schedules.py::test_zero_bubble_with_mixed_precision_tracks_fp32": 4,
    # test_moe_runtime.py
    "test_moe_runtime.py::test_an_expert_parallel_plan_trains_like_one_process": 25,
    "test_moe_runtime.py::test_all_to_all_bytes_match_the_cost_model": 13,
    # test_timing.py
    "test_timing.py::test_op_counts_are_what_the_dispatcher_sees": 35,
    # test_slurm.py
    "test_slurm.py::test_mixed_cluster_is_one_component_per_node_group": 20,
    "test_slurm.py::test_one_node_group_is_a_plain_job": 8,
    # test_moe_costs.py
    "test_moe_costs.py::test_moe_config_json_files_plan": 13,
    "test_moe_costs.py::test_cli_plans_mixtral_and_prints_total_and_active_parameters": 7,
    "test_moe_costs.py::test_mixtral_plans_with_expert_parallelism": 6,
    # test_profiler_comm.py
    "test_profiler_comm.py::test_groups_of_2_and_4_are_measured": 23,
    # test_context_plan.py
    "test_context_plan.py::test_a_context_parallel_plan_trains_like_one_process": 22,
    # test_search_space.py
    "test_search_space.py::test_adding_devices_never_makes_the_predicted_step_slower": 7,
    "test_search_space.py::test_twenty_nodes_are_never_worse_than_sixteen": 6,
    "test_search_space.py::test_the_work_bound_the_grid_skips_by_is_below_every_candidates_step": 6,
    # test_primal.py
    "test_primal.py::test_heuristic_plans_fit_and_are_no_better_than_the_optimum": 17,
    # test_schedules.py
    "test_schedules.py::test_zero_bubble_step_bubble_and_in_flight_are_the_schedules": 7,
    "test_schedules.py::test_interleaved_step_and_in_flight_are_the_schedules": 5,
    # test_runtime_context.py
    "test_runtime_context.py::test_a_model_under_all_to_all_has_the_loss_and_gradients_of_one_process": 7,
    "test_runtime_context.py::test_a_blocks_saved_bytes_under_all_to_all_are_the_cost_models": 4,
    # test_export.py
    "test_export.py::test_megatron_keeps_an_uneven_split_exactly": 8,
    # test_analytic.py
    "test_analytic.py::test_activation_bytes_match_what_the_runtimes_recomputation_keeps": 7,
    # test_specs.py
    "test_specs.py::test_specs_and_search_import_with_torch_blocked": 6,
    # test_profiler_interpolate.py
    "test_profiler_interpolate.py::test_interpolate_and_fit_import_without_torch": 4,
    # test_cli.py
    "test_cli.py::test_bad_input_is_one_line_and_exit_2": 4,
    # test_runtime_models.py
    "test_runtime_models.py::test_forward_shapes_and_missing_parts": 3,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes long on two cores; deselect with -m 'not slow' "
                                       "(the list is SLOW in tests/conftest.py)")


def _keys(item: pytest.Item) -> tuple[str, ...]:
    module = item.path.name
    function = getattr(item, "originalname", item.name)
    return module, f"{module}::{function}", f"{module}::{item.name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    used: set[str] = set()
    for item in items:
        keys = [key for key in _keys(item) if key in SLOW]
        if keys:
            item.add_marker(pytest.mark.slow)
            used.update(keys)
    modules = {item.path.name for item in items}
    # (the items are all collected ones here: -m and -k deselect after this hook)
    stale = sorted(key for key in SLOW if key not in used and key.split("::")[0] in modules)
    if stale:
        warnings.warn(pytest.PytestWarning("tests/conftest.py SLOW names tests that were not collected: "
                                           + ", ".join(stale)))


@pytest.fixture
def torchtitan_config_manager(monkeypatch: pytest.MonkeyPatch):
    """A loader of torchtitan's own ConfigManager module (0.2.x, the last release that reads a
    job TOML); calling it skips the test where torchtitan is not installed. The package's
    __init__ imports its GPU kernels (triton), which a CPU machine lacks; the config modules need
    torch alone, so they are loaded under the package's own path without running that __init__."""
    import importlib
    import importlib.util
    import sys
    import types

    def load():
        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            pytest.skip("torchtitan not installed (pip install 'torchtitan==0.2.2', the last release that reads TOML)")
        for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
            monkeypatch.delitem(sys.modules, name)
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        monkeypatch.setitem(sys.modules, "torchtitan", package)
        return importlib.import_module("torchtitan.config.manager")

    return load
