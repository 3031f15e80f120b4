"""omnistage operator: reconciles OmniStages and arbitrates GPU memory per colocation group.

Where things are (pure modules: no kopf, no network; unit-tested in milliseconds):

=================================  ==========================================================
a concern                          its module
=================================  ==========================================================
the OmniStage's types, parsing     ``spec`` (types), ``spec_parse`` (a stored body to a
                                     ``StageSpec``; the CRD's schema and CEL refuse first)
quantities, byte formatting        ``quantities`` (re-exports ``omnistage_worker.quantities``)
who holds memory, who sleeps       ``arbiter`` (pure package): ``plan`` over ``demand``,
  first, who waits and why           ``admission``, ``sleeps`` (sleep and fence orders),
                                     ``components``, ``gate`` (the wake gate's blockers)
what workers report                ``facts`` (pure): GetStatus and ACKs as typed facts
a group's per-device memory        ``memory`` (pure)
pods, claims, slices as facts      ``pods`` (pure): exit reasons, crash back-off, claim UUIDs
status and its conditions          ``status``, ``conditions`` (pure): one function per condition
the worker pod, Service, claim     ``builders`` (pure): manifests from a ``StageSpec``
the worker's command line, the     ``worker_command``, ``pod_hash``, ``token_secret``
  pod's spec hash, token Secret
one hand-over round                ``handover``: ``rounds`` (observe, sleep, ACK or fence,
                                     checkpoint, wake; against the ``GroupPort`` protocol),
                                     ``orders`` (one sleep, fence or wake)
a round's Kubernetes side          ``port`` (``KubeGroupPort``: the orders), on ``port_facts``
                                     (GetStatus as facts, intents) and ``port_listing`` (the
                                     listing, pods deleted before a round acts), typed
                                     against ``port_host`` (the runner as the port uses it)
a group's stages and pods          ``views``: from kopf's indexes (watches), no LIST per round
the loop per group, what survives  ``runner`` (``GroupRunner``): kicks, asks, fences, learned
  between rounds                     needs, back-offs, worker channels, the token Secret
                                     (its halves: ``group_loops``, ``round_memory``,
                                     ``group_claims``)
status writes and Events           ``publisher``
Kubernetes API calls               ``kube``: kr8s objects, one delete-and-confirm-gone, Events,
                                     per-round request counting
the worker's gRPC client           ``worker_client``
leader election                    ``election`` (pure decisions), ``leader`` (the Lease I/O),
                                     ``leadership`` (what a round checks: leading, epoch)
kopf wiring                        ``handlers`` (thin: indexes, kicks, asks, cleanup)
command line, settings, metrics    ``cli``, ``settings``, ``metrics``, ``labels``
per-stage, per-device gauges       ``stage_metrics``: from the published status; ACK verdicts
=================================  ==========================================================

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
