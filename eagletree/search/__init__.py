"""Tree search: choose which draft nodes one target pass verifies (see docs/design.md)."""

from .calibrate import Calibrator, acceptance_pairs, calibration_report
from .cost import LatencyProfile, choose_budget, choose_depth_and_budget
from .dynamic import eagle2_search, eagle2_tree, optimal_search, optimal_tree, path_expand
from .static import Shape, chain_shape, choices_shape, sequoia_tree, static_search, static_tree

__all__ = [
    "eagle2_tree",
    "optimal_tree",
    "eagle2_search",
    "optimal_search",
    "path_expand",
    "Shape",
    "chain_shape",
    "choices_shape",
    "sequoia_tree",
    "static_tree",
    "static_search",
    "LatencyProfile",
    "choose_budget",
    "choose_depth_and_budget",
    "Calibrator",
    "acceptance_pairs",
    "calibration_report",
]
