"""Serving benchmark client (`moemesh bench`): datasets, load generation over HTTP, metrics, plots. Pure
parts (datasets, schedule, stats) are apart from I/O (client, benchmark, slowdown) and rendering (plots,
report), so the arithmetic is tested on recorded timings without a server."""
