"""kvpage on Ray Serve: replicas that each own one ``AsyncLLM``, an OpenAI-compatible ingress,
and a request router that sends a prompt to the replica caching its longest prefix.

Needs the ``ray`` extra (``pip install "kvpage[ray]"``). Nothing else in kvpage imports this
package; of its modules only ``prefix_policy`` and ``asgi_bridge`` work without Ray.

- ``replica``: the ``KVPageReplica`` deployment (the ``kvpage serve`` app, driven in process)
- ``ingress``: the ``KVPageIngress`` deployment (forwards HTTP, retries on a dead replica)
- ``router``: ``PrefixAwareRequestRouter``, a Ray Serve ``RequestRouter``
- ``prefix_policy``: the routing rule as a pure function
- ``app``: ``build_app`` / ``app_from_args`` -- the Serve application (``kvpage serve --replicas``)
"""
