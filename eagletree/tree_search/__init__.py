"""tree_search (see ../shared/DESIGN.md); filled in by later issues."""
