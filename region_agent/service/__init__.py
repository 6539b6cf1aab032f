"""The agent as a service: the HTTP doors, settings, metrics, tracing, policy reloads and logs."""
