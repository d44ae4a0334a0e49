"""The rollout service: a server that takes TaskRequests over HTTP (`server.py`), gateway nodes
that run their samples through the rollout pipeline (`node.py`, also as Ray actors in
`ray_nodes.py`); its commands `serve`, `node` and `submit` are in `polar_mitm/cli/service.py`. The client a
trainer uses is `polar_mitm.client`."""
