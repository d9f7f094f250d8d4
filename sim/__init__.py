"""The cluster simulator: Shoal's own policies on a simulated cluster, driven by a trace.

    scenario.toml ──load_scenario──▶ Scenario ──load_trace──▶ Trace
                                        │
          for each policy (policies.py) and GPU count (search.py):
              Simulator (engine.py) ── placement passes ──▶ shared/placement (unchanged)
                 │ events: arrivals, completions, loads, drains, releases, reconciler rounds
                 ▼
              RunResult (metrics.py) ──▶ report.py: Markdown table, PNG plots

    scenario.py   the scenario file, validated
    traces.py     generated traces (Poisson / Gamma, Zipf, diurnal), CSV replay, the Azure converter
    policies.py   shoal, dedicated, seed, lru: knobs on one mechanism
    state.py      the simulated cluster, and the policy's view of it (snapshots, occupants)
    engine.py     the event loop: requests, replicas, plans carried out, the reconciler
    wakes.py      the wake coordinator: claim, target, fairness wait, victims, claim
    metrics.py    what a run measures
    search.py     the GPU count each policy needs to meet the SLO
    report.py     the table and the plots
    cli.py        `shoal simulate`

Run it with ``shoal simulate <scenario.toml>``; docs/simulation.md has the details.
"""
