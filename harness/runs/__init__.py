"""The runs that drive engines and judge them, one module each: the parity and top-k cells, probes,
localize, calibration, the calibrated tier measured on a subject (docs/design.md, "Layout").
"""
