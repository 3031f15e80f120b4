"""omnistage operator: reconciles OmniStages and arbitrates GPU memory per colocation group.

Modules (pure logic first):

- ``arbiter``: who may hold a group's memory, who must sleep first, who waits and why (pure).
- ``facts``: typed worker facts from GetStatus answers and ACKs, and what their figures prove
  (an ok sleep ACK the device contradicts, the need a refused wake reports).
- ``memory``: a group's per-device memory from its workers' reports (GPUs only, never host RAM).
- ``status``: the status subresource assembled from those facts (pure, uses ``conditions``).
- ``handover``: one round (observe, sleep, ACK or fence, checkpoint, wake) against a port.
- ``worker_client``: grpc.aio SleepService client (deadlines, bearer token, optional TLS).
- ``kube``: a thin async Kubernetes client (404/409 handled explicitly).
- ``pods``: pods, claims and ResourceSlices read as facts (exit reasons, crash back-off,
  a claim's device UUIDs) (pure).
- ``port``: ``KubeGroupPort``, the Kubernetes side of a round (observe, start, sleep, wake,
  fence); ``runner``: ``GroupRunner``, the serialized loop per group and what survives rounds;
  ``publisher``: status and Events after a round; ``groups`` re-exports them.
- ``election``: leader election's decisions on a Lease (may I acquire, am I still leading,
  which epoch) (pure); ``leader``: the ``Elector`` doing its I/O with kr8s (``leadership``
  is the contract rounds check: ``leading()`` and the epoch every order carries).
- ``handlers`` (kopf, thin), ``cli`` (``omnistage-operator``), ``settings``, ``metrics``.

Decisions beyond the design contract:

- Every replica runs kopf; only the Lease holder acts (rounds, pods, status, orders). A
  standby's handlers write nothing, and its delete handler keeps the finalizer for the leader.

- Among stages of equal priority the most recent ask for Active comes first, so patching a
  stage's ``spec.state`` to Active switches the awake stage; the stage that lost the memory
  keeps wanting Active and shows ``Waiting`` (``waitingFor``) until the memory is free again.
  The ask time is ``status.requestedActiveAt``, persisted before kopf marks the change handled.
- Worker pods are always created asleep; every grab of device memory is a WakeUp through the
  ACK gate (with ``restartPolicy: Never`` from the builders, no restart takes memory either).
- Before any wake the sleepers' ACKs are written to their status (the round's checkpoint).
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
