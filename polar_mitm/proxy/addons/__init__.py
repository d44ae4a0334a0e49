"""mitmproxy addons, one concern each: sessions, routing to the gateway, side-endpoint stubs,
TLS trust watching, and harvest passthrough. Business logic lives outside them."""
