"""HTML reports of training runs (`gcore-rl report RUN_DIR`) and the timeline view shared with the simulator.

Modules: `rundata` reads a run directory, `figures` draws its step metrics, `timeline` draws the
per-device timeline (real and simulated), `page` assembles a self-contained HTML page,
`run_report` puts a run's report together, `environment` records what a run ran on.
"""
