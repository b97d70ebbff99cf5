"""priority-gate: an Envoy ext_authz sidecar that admits LLM requests by priority class."""

__version__ = "0.1.0"
