"""The HTTP server: the protocol and the front that every request passes first."""
