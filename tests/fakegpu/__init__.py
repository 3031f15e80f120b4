"""A simulated GPU for the test harness (never part of the product).

Every worker process on one simulated device shares a directory (:mod:`.device`); the physics
(:mod:`.model`) follow what a real GPU shows through NVML, in everything the operator can
observe through a worker's figures:

- free < total when idle: a driver ``reserve`` (default 0.6% of total, as an H100 shows);
- a ``context`` charge per process at its first touch, before any weight loads (default
  612 MiB scaled to the device: what an H100 shows), visible in every process's ``free``;
- weights: the engine's device bytes (the worker's tensor accounting);
- activations: a request takes ``activation`` bytes (default 25% of the process's weights, or
  absolute bytes) while it runs and the caching allocator keeps them after it ends, until
  ``release_cached`` (after a sleep): a serving stage's peak exceeds its weights; an
  allocation that does not fit raises an OOM worded like CUDA's;
- per-process ``used`` as NVML lists it; ``free = total - reserve - sum over live processes``
  (a dead process's charge vanishes, as the driver frees a killed process's memory);
- faults switched at run time in ``faults.json`` (per pid or ``"*"``): ``leak_on_sleep``
  (a sleep leaves bytes behind, in the process's own figure), ``lie`` (the leaked bytes stay
  on the device but the process's figure omits them), ``slow_serving_s`` (a slow drain),
  ``unlisted`` (NVML no longer lists the process: its own figure reads 0);
- other tenants: :mod:`.tenant` runs a process outside every stage that holds device memory.

A worker uses it through the product's probe seam:
``OMNISTAGE_MEMORY_PROBE=tests.fakegpu.probe:from_env OMNISTAGE_FAKE_GPU=<dir>``.
"""
