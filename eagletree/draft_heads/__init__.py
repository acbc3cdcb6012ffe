"""draft_heads (see ../shared/DESIGN.md); filled in by later issues."""
