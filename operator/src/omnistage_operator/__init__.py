"""omnistage operator: reconciles OmniStages and arbitrates GPU memory per colocation group.

Where things are, by layer (imports point down only: ``api`` < ``decisions`` < ``k8s``
< ``runtime`` < ``cli``; pure modules: no kopf, no network; unit-tested in milliseconds):

- ``api``: the OmniStage's types (``spec``), parsing (``spec_parse``; the CRD's schema and CEL
  refuse first) and parts (``activation``, ``model_source``, ``pod_template``, ``serving``,
  ``worker_tls``), ``pipelines`` (OmniPipeline), ``labels``, ``conditions``.
- ``decisions`` (pure): ``arbiter`` (who holds memory, who sleeps first, who waits and why:
  ``plan`` over ``demand``, ``admission``, ``sleeps``, ``components``, ``gate``, ``wakegate``),
  ``handover`` (one round against the ``GroupPort`` protocol: ``rounds``, ``orders``,
  ``sleep_tasks``), ``facts`` (GetStatus and ACKs as typed facts), ``memory``, ``pods``,
  ``peaks``, ``ondemand``, ``status`` and ``component_status``, ``remembered``,
  ``wake_backoff``, ``election`` (pure Lease decisions), ``leadership``, ``event_series``.
- ``k8s``: ``kube`` (kr8s objects, one delete-and-confirm-gone, Events, request counting),
  ``views`` (kopf's indexes, no LIST per round), ``builders`` (the worker pod, Service, claim),
  ``worker_command``, ``pod_hash``, ``token_secret``, ``claim_slices``, ``group_claims``, the
  group port (``port`` on ``port_facts`` and ``port_listing``, typed against ``port_host``:
  the runner as the port uses it), ``leader`` (the Lease I/O), ``worker_client``,
  ``worker_credentials``, ``settings`` (flags with environment defaults), ``metrics``.
- ``runtime``: ``runner`` (``GroupRunner``: kicks, asks, fences, learned needs, back-offs;
  its halves ``group_loops``, ``round_memory``), ``publisher`` (status writes
  and Events), ``stage_metrics``, ``pipeline_status``, ``demand_watch``, ``handlers`` (thin kopf
  wiring, with ``diffbase``), ``login``, ``election_thread``.
- ``cli``: the ``omnistage-operator`` command.

Decisions beyond the design contract:

- Every replica runs kopf; only the Lease holder acts (rounds, pods, status, orders). A
  standby's handlers write nothing, and its delete handler keeps the finalizer for the leader.

- Among stages of equal priority the most recent ask for Active comes first, so patching a
  stage's ``spec.state`` to Active switches the awake stage; the stage that lost the memory
  keeps wanting Active and shows ``Waiting`` (``waitingFor``) until the memory is free again.
  The ask time is ``status.requestedActiveAt``, written by the round the ask kicked; an
  operator that starts asks now for a stage that wants Active while its status has no ask.
- Worker pods are always created asleep; every grab of device memory is a WakeUp through the
  ACK gate (with ``restartPolicy: Never`` from the builders, no restart takes memory either).
- Before any wake the sleepers' ACKs are sent to their status (the round's checkpoint); the
  wake does not wait for the API's answer, the round's end does (its publish comes after).
- A worker that is Loading, Sleeping or Waking is waited for, not sent a competing order.
- A pod whose containers ended (phase Failed/Succeeded) holds nothing; it is deleted (and the
  deletion confirmed) before the stage gets a new pod. A pod that exists but whose worker does
  not answer holds memory until fenced, unless this process created it and never reached it.
- Real GPU physics (issue 14): free memory is below the total (driver reserve, every process's
  context); a footprint is the largest of ``vram.request``, the peak measured while serving and
  the need a refused wake reported; a stage whose footprint is unknown wakes only when no other
  stage of its group may hold memory; starting pods are charged a context (612 MiB unless a
  worker measured its own) and no wake follows a pod start in the same round; the wake gate
  fails closed; a FAILED worker, a pending fence (persisted in status) and an ok sleep ACK the
  device's free memory contradicts all hold memory until the pod is confirmed gone.
"""
