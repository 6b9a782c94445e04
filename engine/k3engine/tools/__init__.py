"""Companion tools run as `k3 <subcommand>`."""
