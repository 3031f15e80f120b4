"""omnistage operator: reconciles OmniStages and arbitrates GPU memory per colocation group.

Modules (pure logic first):

- ``arbiter``: who may hold a group's memory, who must sleep first, who waits and why (pure).
- ``facts``: typed worker facts from GetStatus answers and ACKs.
- ``status``: the status subresource assembled from those facts (pure, uses ``conditions``).
- ``handover``: one round (observe, sleep, ACK or fence, checkpoint, wake) against a port.
- ``worker_client``: grpc.aio SleepService client (deadlines, bearer token, optional TLS).
- ``kube``: a thin async Kubernetes client (404/409 handled explicitly).
- ``groups``: the Kubernetes port of a round and the serialized loop per group.
- ``handlers`` (kopf, thin), ``cli`` (``omnistage-operator``), ``settings``, ``metrics``.

Decisions beyond the design contract:

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
"""
