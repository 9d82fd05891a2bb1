"""Research on the simulator that only the findings (benchmarks/sim_findings.py) use, kept out of the shipped
package: verl's published runs and the engine-constant fit (`published`), dynamic placement's convergence sweep
(`convergence`), and devices moved between slices (`slice_moves`). Checked by `make bench-check`."""
