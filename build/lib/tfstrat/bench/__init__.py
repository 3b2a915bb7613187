"""Benchmarks behind `tfstrat bench NAME`: real processes, medians of timed repeats, and a
table, a JSON file and a plot written to `--out`. `benchmarks/` holds scripts that call these.
"""
