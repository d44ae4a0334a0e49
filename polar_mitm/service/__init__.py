"""The rollout service: a server that takes TaskRequests over HTTP (`server.py`), gateway nodes
that run their samples through the rollout pipeline (`node.py`, also as Ray actors in
`ray_nodes.py`), and the commands `serve`, `node` and `submit` (`commands.py`). The client a
trainer uses is `polar_mitm.client`."""
