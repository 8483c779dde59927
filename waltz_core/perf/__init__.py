"""``waltz perf``: load drivers, a log-bucketed latency histogram and server profiling."""
