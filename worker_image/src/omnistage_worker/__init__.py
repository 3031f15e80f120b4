"""omnistage worker: serves one model stage and sleeps/wakes it with measured ACKs.

Packages by role: ``serving`` (``server``, the gRPC services, ``auth`` and ``token_review``,
the OpenAI layer ``openai_*`` and ``vllm_front``, the pipeline ``router``, ``metrics_serve``),
``control`` (``sleep_wake`` in the frame of ``transition_acks``: lock, task ids, epochs, Acks;
``transitions`` their pure decisions, ``acks``, ``wake_capacity``, ``oom``, ``component_sleep``,
``demand``, ``queued``, ``prestart`` and ``loading``, ``status`` (GetStatus), ``termination``,
``lane``; ``worker_parts``: the worker as those parts see it, protocols), ``engine`` (weight
movement for the torch runners), ``runners`` (diffusers, transformers, vLLM), ``memory`` (a probe
per device kind: NVML, accounting). At the top: ``state`` (the worker: state, measuring,
Generate), ``cli`` and ``flag_groups`` (flags), ``config`` (validation), ``limits``,
``dtype_choices`` (``--dtype``, shared with the operator's CRD), ``quantities`` (the Kubernetes
quantity grammar, shared with the operator), ``metrics``, ``fetch`` and ``fetch_s3`` with
``sigv4`` (the model's init step), ``jsonlog`` and ``stray_output`` (log lines, shared with the
operator).

Decisions a user of the worker should know:

- Auth: with ``--token-file`` every SleepService call (Sleep, WakeUp, GetStatus) needs
  ``authorization: Bearer <token>``; InferenceService, health and reflection stay open (the token
  guards what can take a GPU away from another stage; inference is the stage's product).
- Task ids: a repeated id joins (or replays) the first transition's Ack, ``replayed=true``; an id
  reused for a different request is INVALID_ARGUMENT; the last 1024 ids are remembered.
  A refused request (INVALID_ARGUMENT, UNAVAILABLE, ...) does not consume its id.
- Sleep at level 1 while asleep at 2 is an ok no-op (the Ack says level 2).
- A sleep refuses new Generate calls at once (FAILED_PRECONDITION "worker is sleeping"), then
  waits for those in flight (up to 10 minutes; past that the Ack is ok=false and the worker
  stays awake).
- The Ack of a sleep is ok=false when the measured memory left exceeds the baseline (the CUDA
  context measured by NVML before any weight loads; 0 on CPU) plus ``--residual-slack``.
- On a device measured by accounting (CPU, or the test harness's simulated GPU) a wake that
  would not fit in the device's free memory is refused with ok=false, as a GPU would fail with
  out-of-memory.
- While the model loads the gRPC server already answers: GetStatus says LOADING, Sleep/WakeUp
  are UNAVAILABLE. A load failure leaves the worker FAILED with the reason (health "" then
  NOT_SERVING, so a liveness probe restarts it).
"""
