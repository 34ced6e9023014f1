"""Pure judgement: thresholds, tiers, verdicts, the top-k tier, failure lines (docs/design.md, "Layout").

Measured numbers and thresholds in, a verdict and its one-line reason out; nothing here runs an engine.
"""
