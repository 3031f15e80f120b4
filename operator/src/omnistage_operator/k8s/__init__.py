"""The Kubernetes side: kr8s objects, views, pod and claim builders, the group port,
the Lease elector and the worker client."""
