"""`tlt simulate`: a discrete-event simulation (simpy) of RL steps on N rollout workers that drives the
scheduler's own policy (scheduler/policy.py) with simulated progress records, validated against this
machine's measured runs and NeMo RL's published 8B figures before it projects to GPU clusters.

    lengths.py   response lengths: a capped lognormal mixture per prompt group, and its fit
    cost.py      a decode step's cost (a roofline per forward), speculative steps, the draft length chosen
    profiles.py  the parameters (workload, cost, acceptance, phases, latencies), validated
    cpu.py       the CPU profile, calibrated on docs/bench/rl.json and scheduler.json
    gpu.py       GPU profiles (8B dense, 235B-class MoE) from published figures
    worker.py    a worker's share as a timeline; its progress record
    service.py   the watcher's tick on simulated records, calling the real policy
    model.py     the driver's steps in simpy; arms plain, frozen, tlt
    validate.py  against tlt bench rl and NeMo RL
    project.py   projections at 8 to 2,048 GPUs; the policy's cost per tick
    run.py       what `tlt simulate` runs; command.py its command line; plots.py its PNGs

Nothing here imports torch (scheduler/ never does).
"""
