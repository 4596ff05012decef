"""`tlt bench ...`: benchmarks that print a JSON object last."""
