"""A prefix-aware router over data-parallel replicas (`llmserve router`, `llmserve serve
--data-parallel-size N`): index.py keeps the block hashes each replica caches (fed by events.py from
the replicas' KV events), prompt.py hashes a request's prompt the engine's way, policy.py picks a
replica, proxy.py forwards (re-sending what had not started), replica.py registers and
health-checks the replicas, metrics.py counts what the router does, app.py is the HTTP front, and
data_parallel.py starts the N replicas behind it.
"""
