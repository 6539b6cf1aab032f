"""Leasehold region agent: the service gateways ask "may this request proceed?"."""
