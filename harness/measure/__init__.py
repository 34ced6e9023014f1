"""Pure measurement: per-position metrics, near-ties, prompt sets, top-k metrics (docs/design.md, "Layout").

Arrays in, arrays and summaries out; nothing here runs an engine or judges a verdict.
"""
