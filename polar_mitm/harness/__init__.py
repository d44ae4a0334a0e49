"""Launching a harness: its environment and CA variables, the local runner, the host installation
containers mount, the Node fetch preload, and the checks before a run."""
