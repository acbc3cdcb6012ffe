"""`eagletree bench`: speculative decoding vs plain and prompt-lookup decoding, on the same prompts in one run.

For every prompt (and temperature), plain HF decoding runs first and every method right after it,
so each speedup is a ratio measured moments apart on the same prompt; the tables report the median
and range of those per-prompt ratios. `eagletree profile` (profile.py) measures the device's
acceptance-independent costs instead (verify latency per tree size, drafting, engine overhead) on random weights.

inputs: the method grid and the prompts; runners: the timed runs; rows: a row's runs, totals and output checks;
stats: summaries and intervals; report: tables, plots and the machine; profile: `eagletree profile` and drafting
costs; command: `main`.
The scripts in benchmarks/ take their prompts, statistics and timing from here too.
"""

from .command import main
from .inputs import (
    BASELINE_LABELS,
    FULL,
    HEADLESS,
    METHODS,
    QUICK,
    TREE_METHODS,
    Method,
    load_prompts,
    method_grid,
    parse_list,
    read_prompt_file,
    sharegpt_heldout,
    spec_count,
)
from .profile import (
    BUILTIN_CONFIGS,
    TimedDrafter,
    build_config,
    measure_drafting,
    measured_tokens_per_pass,
    profile_costs,
    profile_report,
    project,
    random_model,
    random_target,
    sync,
)
from .report import machine_info, markdown_report, markdown_table, write_outputs, write_plots
from .rows import Run, first_difference, logit_gap
from .runners import (
    BenchSettings,
    RunSettings,
    rank_acceptance,
    run_bench,
    run_hf,
    run_method,
    run_tree,
    warm_up,
)
from .stats import calibration_bins, ratio_interval, summarize

__all__ = [
    "BASELINE_LABELS",
    "BUILTIN_CONFIGS",
    "BenchSettings",
    "FULL",
    "HEADLESS",
    "METHODS",
    "QUICK",
    "TREE_METHODS",
    "Method",
    "Run",
    "RunSettings",
    "TimedDrafter",
    "build_config",
    "calibration_bins",
    "first_difference",
    "load_prompts",
    "logit_gap",
    "machine_info",
    "main",
    "markdown_report",
    "markdown_table",
    "measure_drafting",
    "measured_tokens_per_pass",
    "method_grid",
    "parse_list",
    "profile_costs",
    "profile_report",
    "project",
    "random_model",
    "random_target",
    "rank_acceptance",
    "ratio_interval",
    "read_prompt_file",
    "run_bench",
    "run_hf",
    "run_method",
    "run_tree",
    "sharegpt_heldout",
    "spec_count",
    "summarize",
    "sync",
    "warm_up",
    "write_outputs",
    "write_plots",
]
