"""The proxy: mitmproxy's assembly (embedded), its addons, the gateway provider connections are
handed to, the worker processes behind one port, the CA, and harvest mode's exchanges."""
