"""`pagoda bench`: load generation, statistics and reports for Pagoda and its peers.

    workloads.py  what to send          backends.py  where to send it (HTTP, gRPC, HF in-process)
    runner.py     when to send it       metrics.py   what each request measured, and statistics
    bench.py      one benchmark run     report.py    JSON, table, ratios, plots
"""
