"""`polar-mitm view`: a local web page over the store (and a running rollout service).

Sessions, trajectories (the exact tokens a trainer reads, coloured by loss mask and shaded by the
engine's logprob), turns, rollout groups, plots and the live service. `server` reads and routes,
`pages`, `token_pages` (a trajectory, a turn) and `html` render, `tokens` pages a row's tokens, `plots` draws SVG, `live` relays the
service's event stream; its command is `polar_mitm/cli/view.py`.
"""
