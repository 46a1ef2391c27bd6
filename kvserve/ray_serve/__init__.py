"""kvserve under Ray Serve (docs/deploy.md): `serve run deploy/ray/kvserve.yaml`.

Two deployments. `KvserveIngress` (ingress.py) takes HTTP from Serve's proxy, reads the body and
hands the whole request to a `KvserveReplica` (replica.py: one engine and kvserve's own app,
called in-process) through a deployment handle; the handle's request router is kvserve's
cache-aware policy (router.py), fed by each replica's held KV blocks (its routing stats). The
body must reach the router for it to see the prompt, which is why the replicas are not the
ingress themselves: Serve's proxy sends an ingress the headers only.

Importing this package needs Ray (`pip install kvserve[ray]`); the rest of kvserve does not.
"""
