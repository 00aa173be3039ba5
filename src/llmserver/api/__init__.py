"""Thin HTTP routers, one file per surface: each parses, calls one service, returns."""
